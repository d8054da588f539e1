"""`--sample-prompts`: a few completions at each evaluation, so the user sees the model change.

The first MAX_PROMPTS prompts of the file (rows as `leantune generate --prompts` reads them:
`{"prompt": text}` rows asked in the prompt format of the data being trained on) are completed
greedily by the model as trained so far (LoRA unmerged, eval mode, no gradients) before training, at
every evaluation and at the end; each completion is appended to OUTPUT/samples.jsonl as {"step",
"prompt", "completion"}.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import LeantuneError

SAMPLES = "samples.jsonl"
MAX_PROMPTS = 4


class SampleWriter:
    """Reads and tokenizes the prompts at once (a bad file fails before the model loads). With
    the model's config, a prompt that leaves no room in its context is refused then too, and
    one that leaves less than --sample-max-new-tokens is said once (its samples stop at the
    context)."""

    def __init__(self, path: str, tokenizer, output: Path, max_new_tokens: int,
                 model_config=None, log=print, trained_as: str | None = None,
                 rows: list | None = None):
        """trained_as: the prompt format of the training data (prompts.TRAINED_AS; None: the
        tokenizer's default, as generate's for a run that says none). rows: the file's rows as
        read_prompt_file read them (read here when None)."""
        from ..generate.context import PromptTooLong, fit_to_context
        from ..generate.prompts import (in_format, prompt_ids, read_prompt_file,
                                        resolve_prompt_format)

        if tokenizer is None:
            raise LeantuneError("--sample-prompts needs the model's tokenizer")
        rows = (read_prompt_file(path) if rows is None else rows)[:MAX_PROMPTS]
        self.prompts = [prompt for _, prompt, _ in rows]  # (as the file has them)
        rows = in_format(rows, resolve_prompt_format(None, trained_as, tokenizer))
        self.ids = [prompt_ids(tokenizer, prompt, where) for _, prompt, where in rows]
        self.tokenizer = tokenizer
        self.path = Path(output) / SAMPLES
        self.max_new_tokens = max_new_tokens
        if model_config is not None:
            notes = []
            try:
                fit_to_context(self.ids, [where for _, _, where in rows], max_new_tokens,
                               model_config, log=notes.append)
            except PromptTooLong as e:
                raise LeantuneError(
                    f"--sample-prompts {path}: a prompt of {e.tokens:,} tokens{e.how} leaves no "
                    f"room in the model's {e.context:,}-token context; shorten it or leave it "
                    "out") from None
            if notes:  # (fit_to_context's note, in train's words)
                said = notes[0].split("note: ", 1)[-1]
                log("note: --sample-prompts: "
                    + said.replace("--max-new-tokens", "--sample-max-new-tokens"))

    def write(self, model, step: int) -> str:
        """Complete the prompts with `model` (its mode is restored) and append the rows;
        returns the first completion."""
        from ..generate import generate
        from ..utils.io import open_append

        done = generate(model, self.tokenizer, self.ids, max_new_tokens=self.max_new_tokens,
                        cuda_graphs=False, log=lambda _: None)  # (the cap: said at set-up)
        with open_append(self.path) as f:  # (a link there is refused, never followed)
            for prompt, g in zip(self.prompts, done):
                f.write(json.dumps({"step": step, "prompt": prompt, "completion": g.text}) + "\n")
        return done[0].text
