"""The step runner: everything of a training run after its set-up, the same for every objective.

    for each optimizer step:
        take grad_accum micro-batches (the window)
        n = objective.normaliser(window)           (host int: no sync; the global window's)
        for each micro-batch: (objective.loss(model, b).loss_sum / n).backward()
            (under DDP / FSDP2 gradients are reduced after the last one only: no_sync)
        clip, AdamW step, lr from the schedule, zero grads
        log loss / metrics / lr / grad norm / tokens/s / peak memory; eval and checkpoint when due

Dividing by the units (target tokens for SFT) of the whole accumulation window makes 4
micro-batches with accumulation 4 give exactly the gradient of one batch of 4 (tested), unlike
averaging per-micro-batch means. An objective's metrics (MicroLoss.metrics: sums over its units)
are logged the same way, as the window's sums over the normaliser, and evaluation reports
eval_loss and eval_<metric>. `objective.prepare` runs once before the first step of each call
(a fresh run, and again on resume).

The last step is always checkpointed, so a finished run can be resumed (nothing to do) or
extended (a larger --max-steps / --epochs), and a run stopped after that checkpoint (in its final
evaluation, save, plot or merge) is finished by --resume: `_already_finished` does what is left.
Ctrl-C and SIGTERM checkpoint and stop; a NaN / inf loss stops the run without writing its result
(at the first step, a weight of the checkpoint holding NaN / inf is named instead of the learning
rate: `_nonfinite_weight`).

`StepRunner` is the base of train/trainer.py's Trainer, whose set-up gives it: cfg, log, output,
device, parallel, model (and forward_model: the DDP / FSDP2-wrapped one), params, optimizer,
scaler, objective, loader, eval_loader, total_steps, samples, run_folder, watch, and the run's
state (step, tokens_seen, first_eval_loss, saved_step, router_aux_loss, step_metrics); and the
methods that write what a run keeps: run_settings, save_checkpoint, save_final.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..dist.tensors import full_tensor
from ..errors import LeantuneError
from ..utils import signals
from ..utils.io import atomic_write_json, atomic_write_text, refuse_link_at
from .checkpoint import _rng_state, _set_rng_state, latest_checkpoint
from .health import diverged_advice
from .merge_at_end import MERGED_DIR, merge_at_end, merge_outdated
from .metrics import NoMetrics, Progress
from .output import RUN_CONFIG, final_incomplete, overwrite_stopped_note, resume_hint
from .plot import PLOT_NAME, plot_after_training, plot_outdated
from .reporting import open_reporting
from .samples import SAMPLES
from .schedule import lr_factor


@dataclass
class TrainResult:
    steps: int
    train_loss: float | None
    first_eval_loss: float | None
    final_eval_loss: float | None
    output: Path
    tokens_per_s: float
    steps_run: int = 0  # steps this call ran (0: the run had already finished)
    skipped_steps: int = 0  # fp16: updates the loss scaler skipped (gradient overflow)


class StepRunner:
    """Runs a set-up training run (module docstring): `train()`."""

    def _set_lr(self, step: int) -> float:
        lr = self.cfg.lr * lr_factor(step, self.cfg.warmup_steps, self.total_steps,
                                     self.cfg.schedule)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        return lr

    def train_step(self, micro_batches) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Forward/backward over the window, clip, step. Returns (loss, grad norm, tokens): the
        window's loss (the objective's loss sums over its normaliser), on the device (no host
        sync here), and its real tokens. The objective's metrics of the window (their sums over
        the normaliser) are left in `step_metrics`. Under torchrun the normaliser and the tokens
        are the global window's (dist/data.py), the sums are summed over the processes, and
        gradients are reduced after the window's last micro-batch (dist/parallel.py). With
        --router-aux-loss-coef the router's load-balancing loss (its mean over the window:
        `router_aux_loss`) is added, times the coefficient; the loss returned is the
        objective's alone."""
        objective = self.objective
        n = max(1, objective.normaliser(micro_batches))
        scale = self.parallel.grad_scale
        loss_total = torch.zeros((), device=self.device, dtype=torch.float32)
        names = objective.metric_names
        metric_totals = [torch.zeros((), device=self.device, dtype=torch.float32) for _ in names]
        coef, aux_total = self.cfg.router_aux_loss_coef, None
        for i, b in enumerate(micro_batches):
            b = b.to(self.device)
            with self.parallel.micro_batch(self.model, last=i == len(micro_batches) - 1):
                out = objective.loss(self.forward_model, b)
                loss = out.loss_sum / n
                if out.aux_loss is not None:
                    aux = out.aux_loss / len(micro_batches)
                    loss = loss + coef * aux
                    aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
                if scale != 1:  # DDP and FSDP2 average over processes: the sum is wanted
                    loss = loss * scale
                (self.scaler.scale(loss) if self.scaler else loss).backward()
            loss_total += out.loss_sum.detach()
            for total, name in zip(metric_totals, names):
                total += out.metrics[name].detach().float()
        if names:  # the loss and the metrics in one all-reduce
            sums = self.parallel.sum_(torch.stack([loss_total, *metric_totals]))
            loss_total = sums[0]
            finish = getattr(objective, "finish_metrics", None)  # (its own normalisers)
            self.step_metrics = (finish(dict(zip(names, sums[1:])), n) if finish is not None
                                 else dict(zip(names, sums[1:] / n)))
        else:
            self.parallel.sum_(loss_total)
        self.router_aux_loss = aux_total
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_total / n, grad_norm, objective.tokens(micro_batches)

    def _window(self, batches) -> list:
        """The micro-batches of the next step: the objective's (`next_window`: GRPO makes its
        rollouts here), else grad_accum batches from the loader."""
        make = getattr(self.objective, "next_window", None)
        if make is not None:
            return make(self, batches)
        return [next(batches) for _ in range(self.cfg.grad_accum)]

    def _host_metrics(self, record: dict, ntok: int, dt: float, values: dict) -> dict:
        """Add the objective's host metrics (`host_metrics`) to the step's record, with
        train_tokens_per_s (the step's tokens over its time outside generation); returns what
        the progress line shows (`progress_metrics`, else the objective's device metrics)."""
        host = getattr(self.objective, "host_metrics", None)
        if host is None:
            return values
        extra = host()
        record.update(extra)
        if "generation_s" in extra:
            record["train_tokens_per_s"] = ntok / max(dt - extra["generation_s"], 1e-9)
        show = getattr(self.objective, "progress_metrics", None)
        return show(record) if show is not None else values

    def evaluate_metrics(self) -> dict[str, float]:
        """The objective's evaluation over the eval data: {"eval_loss": ..., "eval_<metric>":
        ...} (one host read); {} without eval data."""
        if self.eval_loader is None:
            return {}
        self.model.eval()
        try:
            return self.objective.evaluate(self.model, self.eval_loader, self.parallel)
        finally:
            self.model.train()

    def evaluate(self) -> float | None:
        """The eval loss (None without eval data)."""
        return self.evaluate_metrics().get("eval_loss")

    def write_samples(self, progress) -> None:
        """--sample-prompts: complete them with the model as it is now (samples.py)."""
        if self.samples is not None:
            first = self.samples.write(self.model, self.step)
            progress.write(f"step {self.step}: sample: {' '.join(first.split())[:100]!r}")

    def train(self) -> TrainResult:
        """Run to `total_steps`. With --overwrite the previous run is set aside first, deleted
        at this run's first checkpoint, and put back if the run stops before it."""
        if self.step >= self.total_steps:
            with signals.as_interrupts():
                return self._already_finished()
        with signals.as_interrupts():
            if self.parallel.writer:
                self.run_folder.begin(overwrite=self.cfg.overwrite)
            try:
                return self._train()
            except BaseException:
                self.run_folder.restore()
                raise
            finally:
                # streamed base weights back on the GPU: what the caller does next (export,
                # generate) reads the weights directly
                self.engine.unstream(self.model)

    def _train(self) -> TrainResult:
        cfg = self.cfg
        writer = self.parallel.writer  # (under torchrun rank 0 alone writes and reports)
        if writer:
            atomic_write_json(self.output / RUN_CONFIG, self.run_settings())
        if cfg.resume and writer:  # drop records a crash left after the checkpoint: redone
            drop_metrics_after(self.output / "metrics.jsonl", self.step)
            drop_metrics_after(self.output / SAMPLES, self.step)
        # metrics.jsonl (+ --report-to)
        metrics = open_reporting(cfg, start_step=self.step) if writer else NoMetrics()
        progress = Progress(self.total_steps, initial=self.step, bar=cfg.progress,
                            quiet=not writer)
        last_loss, eval_loss = None, self.first_eval_loss
        t_start = time.perf_counter()
        tokens_run, start_step = 0, self.step
        self.watch.good_until = self.step
        step_start = None
        completed = False  # the loop ran to the last step (its checkpoint is written)
        try:
            # the objective's set-up over the data (a fresh run and each resume)
            self.objective.prepare(self.model, self.loader, self.parallel)
            if self.first_eval_loss is None:
                first = self.evaluate_metrics()
                self.first_eval_loss = first.get("eval_loss")
                if first:
                    metrics.write({"step": self.step, **first})
                    progress.write(f"{eval_text(first)} before training")
            if self.step == 0:
                self.write_samples(progress)
            batches = (batch for _, _, batch in self.loader.iter_batches())
            if self.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(self.device)
            # --full: the weights as loaded, summed before the first step changes them
            # (`_nonfinite_weight`; on the device, not read unless that step diverges)
            self.first_weight_sums = (self._weight_sums(trainable=True)
                                      if cfg.full and self.step == 0 else [])
            # tokens/s and the ETA from here: the set-up, the first evaluation and samples
            # above are not training time
            t_start = time.perf_counter()
            while self.step < self.total_steps:
                t0 = time.perf_counter()
                # where this step starts: an interrupt before it ends checkpoints from here
                step_start = (self.step, self.loader.state_dict(), _rng_state())
                lr = self._set_lr(self.step)
                window = self._window(batches)
                loss, gnorm, ntok = self.train_step(window)
                self.watch.observe(loss, gnorm)
                self.step += 1
                self.tokens_seen += ntok
                tokens_run += ntok
                record = None
                if self.step % cfg.log_every == 0 or self.step == self.total_steps:
                    # the one sync per logged step
                    aux = [] if self.router_aux_loss is None else [self.router_aux_loss]
                    names = list(self.step_metrics)
                    (last_loss, grad_norm, *rest), bad, skipped = self.watch.read(
                        self.step, loss, gnorm, *aux,  # (the aux loss and metrics in one copy)
                        *(self.step_metrics[k] for k in names))
                    aux, values = rest[:len(aux)], dict(zip(names, rest[len(aux):]))
                    dt = time.perf_counter() - t0
                    elapsed = time.perf_counter() - t_start
                    tok_s = tokens_run / max(elapsed, 1e-9)
                    steps_run = self.step - start_step
                    eta = (self.total_steps - self.step) * elapsed / max(steps_run, 1)
                    record = {"step": self.step, "loss": last_loss, "lr": lr,
                              "grad_norm": grad_norm, "tokens_per_s": tok_s,
                              "step_time_s": dt, "tokens_seen": self.tokens_seen,
                              "peak_mem_gib": peak_memory_gib(self.device)}
                    if self.scaler is not None:
                        record["skipped_steps"] = skipped
                    if aux:
                        record["router_aux_loss"] = aux[0]
                    record.update(values)
                    shown = self._host_metrics(record, ntok, dt, values)
                    if bad:
                        metrics.write(record)
                        raise self._diverged(last_loss, grad_norm)
                    stalled = (self.watch.stall.check(self.step, cfg, warn=progress.write)
                               if getattr(self.objective, "checks_stall", True) else None)
                    if stalled:  # health.StallWatch: the gradient norm stuck at exactly 0
                        metrics.write(record)
                        raise stalled
                    progress.update(self.step, last_loss, tok_s, eta_s=eta,
                                    **({"metrics": shown} if shown else {}))
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < self.total_steps:
                    ev = self.evaluate_metrics()
                    if ev:
                        eval_loss = ev.get("eval_loss")
                        (record := record or {"step": self.step}).update(ev)
                        progress.write(f"step {self.step}: {eval_text(ev)}")
                    self.write_samples(progress)
                if record:
                    metrics.write(record)
                if (cfg.save_every and self.step % cfg.save_every == 0) \
                        or self.step == self.total_steps:
                    self.save_checkpoint()
            ev = self.evaluate_metrics()
            eval_loss = ev.get("eval_loss")
            if ev:
                metrics.write({"step": self.step, **ev})
                progress.write(f"step {self.step}: {eval_text(ev)}")
            self.write_samples(progress)
            skipped = self.watch.read(self.step)[2]
            if skipped:
                progress.write(f"note: the fp16 loss scaler skipped {skipped} of "
                               f"{self.step - start_step} updates (gradient overflow: it skips "
                               "the update and lowers the scale, by design)")
            completed = True
        except KeyboardInterrupt as interrupt:
            try:
                progress.close()
                err = self._stopped(interrupt, start_step, step_start)
            except KeyboardInterrupt:  # again, while checkpointing: stop now
                err = self._stopped_again(interrupt)
            raise err from None
        finally:
            if not completed:
                progress.close()
                metrics.close()
                self.engine.unstream(self.model)
        with self._finishing():  # (the last step's checkpoint is written: --resume finishes)
            progress.close()
            metrics.close()  # (wandb's finish can take seconds: a Ctrl-C there is this one)
            self.engine.unstream(self.model)  # (before the final save: train() does it too)
            self.save_final()
            elapsed = time.perf_counter() - t_start
            if writer:
                plot_after_training(self.output, self.log)
                if cfg.merge_at_end:
                    merge_at_end(cfg, self.log)
        return TrainResult(self.step, last_loss, self.first_eval_loss, eval_loss, self.output,
                           tokens_run / max(elapsed, 1e-9), steps_run=self.step - start_step,
                           skipped_steps=skipped)

    def _stopped(self, interrupt: KeyboardInterrupt, start_step: int, step_start) -> LeantuneError:
        """The one line for a Ctrl-C / SIGTERM: checkpoint what was trained, say how to go on."""
        what = signals.describe(interrupt)
        # no step finished: nothing worth a checkpoint; under torchrun the other processes may
        # be anywhere in a step (in a collective, or stopped): none is written from here
        if self.step == start_step or self.parallel.launched or self.run_folder.pending:
            if self.run_folder.pending:  # (this run is worth less than it: output.py)
                note = overwrite_stopped_note(self.output, self.step - start_step)
            elif self.saved_step is not None:
                note = (f"its checkpoint at step {self.saved_step} is unchanged; continue with "
                        "the same command plus --resume")
            else:
                note = "nothing was saved; run the command again to start over"
            when = ("before the first step finished" if self.step == start_step else
                    f"at step {self.step}" if self.run_folder.pending else
                    f"at step {self.step} (under torchrun a stop writes no checkpoint; "
                    "--save-every sets how often one is written)")
            err = LeantuneError(f"{what} {when}; {note}")
        else:
            if step_start is not None and step_start[0] == self.step:
                # interrupted mid-step: its batches were drawn and its dropout RNG used, but no
                # update was counted; rewind both so --resume redoes the step exactly
                self.loader.load_state_dict(step_start[1])
                _set_rng_state(step_start[2])
            path = self.save_checkpoint()
            err = LeantuneError(f"{what} at step {self.step}; checkpoint saved to {path}; "
                                f"continue with {resume_hint(self.cfg)}")
        err.exit_code = signals.exit_code(interrupt)
        return err

    def _stopped_again(self, interrupt: KeyboardInterrupt) -> LeantuneError:
        """The one line for a second Ctrl-C / SIGTERM while the first one's checkpoint was
        being written: that checkpoint is not there (a half-written one is never used)."""
        last = latest_checkpoint(self.output)
        note = (f"the previous run in {self.output} is put back as it was"
                if self.run_folder.pending else
                "there is no earlier one; run the command again to start over" if last is None
                else f"--resume continues from {last}")
        err = LeantuneError(f"{signals.describe(interrupt)} again while saving the checkpoint of "
                            f"step {self.step}, so it was not saved; {note}")
        err.exit_code = signals.exit_code(interrupt)
        return err

    def _diverged(self, loss: float | None = None, grad_norm: float | None = None
                  ) -> LeantuneError:
        """The one line for a NaN / inf: what to try; nothing of the diverged weights is kept.
        `loss` and `grad_norm`: this step's, when it is the step that was read."""
        if loss is not None and not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"the loss is {loss} and the gradient norm {grad_norm}"
        else:
            what = "the loss or the gradient norm became NaN or infinite"
        first = self.watch.good_until + 1
        steps = f"step {self.step}" if first >= self.step else f"steps {first}-{self.step}"
        ckpt = None if self.run_folder.pending else latest_checkpoint(self.output)
        kept = (f"the last good checkpoint {ckpt} is kept" if ckpt is not None
                else "no checkpoint was written")
        result = "model" if self.cfg.full else "adapter"
        bad = self._nonfinite_weight() if first <= 1 else None
        if bad is not None:  # a damaged checkpoint, not the learning rate
            where = (f"--model {self.cfg.model}" if self.cfg.model else "the model") + (
                f" (or --adapter {self.cfg.adapter}, folded into it)" if self.cfg.adapter else "")
            return LeantuneError(f"{steps}: {what}: the model's weight {bad} holds NaN or "
                                 f"infinite values before training changed it; {where} is "
                                 "damaged: download or export it again")
        return LeantuneError(f"{steps}: {what}: training diverged and stopped, and no final "
                             f"{result} was written ({kept}); {diverged_advice(self.cfg)}, in "
                             "a new run (--overwrite)")

    def _nonfinite_weight(self) -> str | None:
        """The name of a floating-point weight that held NaN / inf before training changed it
        (None: none did): at the first step such a loss comes from the checkpoint, not from
        training. Frozen weights are read now; trained ones (--full) by their sums taken before
        the first step, whose update has since spread the NaN to every one of them."""
        sums = self._weight_sums(trainable=False) + getattr(self, "first_weight_sums", [])
        return next((name for name, total in sums if not bool(total.isfinite())), None)

    def _weight_sums(self, trainable: bool) -> list[tuple[str, torch.Tensor]]:
        """(name, fp32 sum) of each floating-point weight that is trainable, or frozen (FSDP2:
        this process's shard), on its device and not read back: NaN / inf carry through a sum,
        and no copy of a weight is made."""
        sums = []
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                t = p.to_local() if hasattr(p, "to_local") else p
                if p.requires_grad != trainable or not t.is_floating_point() or not t.numel():
                    continue
                try:
                    sums.append((name, t.sum(dtype=torch.float32)))
                except RuntimeError:  # (a dtype without a sum here: not checked)
                    continue
        return sums

    def _already_finished(self) -> TrainResult:
        """`--resume` of a run that reached its last step: nothing to train. What a stop after
        the last checkpoint left undone (`_left_undone`) is done now, as the uninterrupted run
        does it: the final evaluation, samples, final adapter (or model), loss.png and merged/.
        A run with nothing left undone is not touched."""
        todo = self._left_undone()
        if not any(todo.values()):
            self.log(f"{self.output}: the run already finished at step {self.step}; nothing to "
                     "do (to train on, --resume with a larger --max-steps or --epochs)")
            if self.parallel.writer and plot_outdated(self.output):  # (a stop in the plot)
                plot_after_training(self.output, self.log)
            return TrainResult(self.step, None, self.first_eval_loss, self._final_eval_loss(),
                               self.output, 0.0)
        result = "model" if self.cfg.full else "adapter"
        names = {"eval": "the final evaluation", "samples": "the final samples",
                 "final": f"the final {result}", "plot": PLOT_NAME, "merge": f"{MERGED_DIR}/"}
        self.log(f"{self.output}: the run stopped after its last checkpoint (step {self.step}) "
                 f"before it finished; finishing it: "
                 f"{', '.join(names[k] for k, undone in todo.items() if undone)}")
        cfg, writer, ev = self.cfg, self.parallel.writer, {}
        try:
            with self._finishing():
                if todo["eval"]:
                    self.objective.prepare(self.model, self.loader, self.parallel)  # (its tables)
                    ev = self.evaluate_metrics()
                    if writer and ev:
                        drop_metrics_after(self.output / "metrics.jsonl", self.step)  # (a cut line)
                        metrics = open_reporting(cfg, start_step=self.step + 1)
                        try:
                            metrics.write({"step": self.step, **ev})
                        finally:
                            metrics.close()
                    if ev:
                        self.log(f"step {self.step}: {eval_text(ev)}")
                if todo["samples"]:  # (a part of them written: written again)
                    if writer:
                        drop_metrics_after(self.output / SAMPLES, self.step - 1)
                    self.write_samples(_LogLines(self.log))
                self.engine.unstream(self.model)  # (before the final save, as in _train)
                if todo["final"]:
                    self.save_final()
                    self.log(f"wrote the final {result} from {latest_checkpoint(self.output)}")
                if writer and todo["plot"]:
                    plot_after_training(self.output, self.log)
                if writer and todo["merge"]:
                    merge_at_end(cfg, self.log)
        finally:
            self.engine.unstream(self.model)
        final = ev.get("eval_loss") if ev else self._final_eval_loss()
        if self.first_eval_loss is not None and final is not None:
            self.log(f"eval loss: {self.first_eval_loss:.4f} -> {final:.4f}")
        return TrainResult(self.step, None, self.first_eval_loss, final, self.output, 0.0)

    def _left_undone(self) -> dict[str, bool]:
        """What the end of a run that reached its last step still has to do (a stop after the
        last checkpoint): "eval" (the objective evaluates and metrics.jsonl has no eval record
        of the last step), "samples" (not all of the last step's), "final" (final files
        incomplete: output.final_incomplete), "plot" (loss.png missing or older than the
        metrics, beside something else undone), "merge" (--merge-at-end: merged/ missing, cut
        short or older than the adapter). Read by the writer; under torchrun every process
        learns its answer (an all-reduce), as every one takes part in the evaluation and the
        final save."""
        keys = ("eval", "samples", "final", "plot", "merge")
        flags = [False] * len(keys)
        if self.parallel.writer:
            out, step = self.output, self.step
            evals = [r for r in _records(out / "metrics.jsonl") if r.get("step") == step
                     and "eval_loss" in r]
            samples = [r for r in _records(out / SAMPLES) if r.get("step") == step]
            final = final_incomplete(out, self.cfg.full, latest_checkpoint(out)) is not None
            # (an objective that evaluates: the run's first evaluation gave a loss; GRPO's none)
            flags = [self.eval_loader is not None and self.first_eval_loss is not None
                     and not evals,
                     self.samples is not None and len(samples) < len(self.samples.prompts),
                     final]
            merge = bool(self.cfg.merge_at_end) and (final or merge_outdated(out) is not None)
            # (a new eval record: drawn again; an old plot alone is no sign of a stop, as a plot
            # that failed writes none: `_already_finished` redraws it quietly)
            flags += [flags[0] or (plot_outdated(out) and (any(flags) or merge)), merge]
        if self.parallel.launched:
            agreed = torch.tensor(flags, dtype=torch.int32, device=self.device)
            flags = [bool(f) for f in self.parallel.sum_(agreed).tolist()]
        return dict(zip(keys, flags))

    def _final_eval_loss(self) -> float | None:
        """The eval loss of the last step, from metrics.jsonl (None: none there, or not the
        writer)."""
        if not self.parallel.writer:
            return None
        evals = [r["eval_loss"] for r in _records(self.output / "metrics.jsonl")
                 if r.get("step") == self.step and "eval_loss" in r]
        return evals[-1] if evals else None

    @contextlib.contextmanager
    def _finishing(self):
        """Around what follows the last step's checkpoint (the final evaluation of a resumed run,
        the final save, the plot, the merge): a Ctrl-C / SIGTERM there (or the error a library
        made of one) ends in one line that says so and how to finish (`_stopped_finishing`)."""
        try:
            yield
        except KeyboardInterrupt as interrupt:
            raise self._stopped_finishing(interrupt) from None
        except Exception:
            interrupt = signals.received()
            if interrupt is None:
                raise
            raise self._stopped_finishing(interrupt) from None

    def _stopped_finishing(self, interrupt: KeyboardInterrupt) -> LeantuneError:
        """The one line for a Ctrl-C / SIGTERM after the last step's checkpoint: nothing trained
        is lost, and --resume does what the run had left (`_already_finished`)."""
        how = "the same command again" if self.cfg.resume else resume_hint(self.cfg)
        err = LeantuneError(f"{signals.describe(interrupt)} after the last step ({self.step}); its "
                            f"checkpoint {latest_checkpoint(self.output)} is saved; finish the "
                            f"run with {how}")
        err.exit_code = signals.exit_code(interrupt)
        return err


class _LogLines:
    """`log` where the runner writes to its progress (`write`): a resumed run's end has none."""

    def __init__(self, log):
        self.write = log


def _records(path: Path) -> list[dict]:
    """The JSON records of a .jsonl file (metrics.jsonl, samples.jsonl); a line a crash cut
    short, or anything not a record, is left out; [] for no file."""
    try:
        lines = path.read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return []
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def eval_text(ev: dict[str, float]) -> str:
    """"eval loss 1.2345" and the objective's eval metrics, for the progress line."""
    extra = "".join(f", {k} {v:.4f}" for k, v in ev.items() if k != "eval_loss")
    return f"eval loss {ev['eval_loss']:.4f}{extra}"


def drop_metrics_after(path: Path, step: int) -> None:
    """Keep only the records of steps <= `step` in metrics.jsonl (resuming from `step`)."""
    refuse_link_at(path, "metrics log")  # (its target's lines would be copied in)
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) > step:
                continue
        except (ValueError, AttributeError):
            continue  # a line cut short by the crash
        keep.append(line if line.endswith("\n") else line + "\n")
    if len(keep) != len(lines):
        atomic_write_text(path, "".join(keep))


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB (Linux)
