"""TrainConfig's sections: `lora`, `engine` and `objective` nest the settings as they are used;
the flat names (flags, YAML keys, keywords) map into them, and a flat run_config.json written
before the sections (run_config_fd9c0ae.json: by commit fd9c0ae's trainer) still reads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from leantune.cli import main
from leantune.engine.options import EngineOptions
from leantune.errors import LeantuneError
from leantune.export.merge import _checkpoint_lora
from leantune.train import objectives
from leantune.train.config import (EngineSettings, LoRASettings, ObjectiveSettings, TrainConfig,
                                   load_yaml_config)
from leantune.train.objectives import SFTObjective

OLD = json.loads(Path(__file__).with_name("run_config_fd9c0ae.json").read_text())


def test_flat_names_set_the_sections():
    cfg = TrainConfig(lora_r=4, lora_targets="q,v", kernels="reference", mlp_chunk_mib=1.5,
                      beta=0.2, objective="sft", lr=1e-3)
    assert cfg.lora == LoRASettings(r=4, targets="q,v")
    assert cfg.engine == EngineSettings(kernels="reference", mlp_chunk_mib=1.5)
    assert cfg.objective == ObjectiveSettings(name="sft", beta=0.2) and cfg.lr == 1e-3
    assert cfg.get("lora_r") == 4 and cfg.get("objective") == "sft" and cfg.get("lr") == 1e-3
    # a flat name wins over the section given beside it; a section may be a mapping
    both = TrainConfig(lora={"r": 8, "alpha": 4.0}, lora_r=2, objective={"name": "sft"})
    assert both.lora == LoRASettings(r=2, alpha=4.0) and both.objective == ObjectiveSettings()
    # replace() with a flat name: a new section; the original is untouched
    more = dataclasses.replace(cfg, lora_r=16, resume=True)
    assert more.lora.r == 16 and more.resume and cfg.lora.r == 4 and more.lora.targets == "q,v"
    assert dataclasses.replace(cfg).lora is not cfg.lora
    with pytest.raises(TypeError, match="unknown option"):
        TrainConfig(lora_rank=4)


def test_sections_build_the_checked_settings():
    cfg = TrainConfig(lora_r=4, lora_targets="v,q", use_rslora=True, attention="flash")
    lora = cfg.lora.build()
    assert (lora.r, lora.targets, lora.use_rslora) == (4, ["q_proj", "v_proj"], True)
    assert cfg.engine_options() == EngineOptions(attention="flash")
    # the engine section mirrors EngineOptions field for field
    assert [f.name for f in dataclasses.fields(EngineSettings)] == [
        f.name for f in dataclasses.fields(EngineOptions)]
    with pytest.raises(LeantuneError, match="--lora-r must be a positive integer"):
        TrainConfig(lora_r=0).lora.build()


def test_saved_configs_read_back_nested_and_flat():
    cfg = TrainConfig(lora_r=4, kernels="reference", max_steps=3)
    saved = dataclasses.asdict(cfg)
    assert "lora_r" not in saved and saved["lora"]["r"] == 4 and saved["objective"]["name"] == "sft"
    assert TrainConfig.from_dict(json.loads(json.dumps(saved))) == cfg
    # the flat form today's runs (before the sections) wrote
    old = OLD["config"]
    assert "lora_r" in old and "lora" not in old
    was = TrainConfig.from_dict({**old, "a_removed_option": 1})
    assert was.lora == LoRASettings(r=4, alpha=8.0, targets="q,v", use_rslora=True)
    assert was.engine.build() == EngineOptions.from_dict(OLD["engine_options"])
    assert was.engine.mlp_chunk_mib == 1.5 and was.objective == ObjectiveSettings()
    assert (was.max_steps, was.max_seq_len, was.model) == (1, 64, "/somewhere/model")


@pytest.mark.parametrize("config", [OLD["config"], dataclasses.asdict(TrainConfig.from_dict(
    OLD["config"]))], ids=["flat", "nested"])
def test_export_reads_a_checkpoints_lora_settings(tmp_path, config):
    (tmp_path / "state.json").write_text(json.dumps({"config": config}))
    lora = _checkpoint_lora(tmp_path)
    assert (lora.r, lora.alpha, lora.targets, lora.use_rslora) == (4, 8.0, ["q_proj", "v_proj"],
                                                                   True)


def test_yaml_sections_and_flat_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("lora:\n  r: 8\n  alpha: 1e1\nengine: {kernels: reference}\nlora-dropout: 0.1\n"
                    "objective: sft\nlr: 1e-3\n")
    values = load_yaml_config(str(path))
    assert values == {"lora": {"r": 8, "alpha": 10.0}, "engine": {"kernels": "reference"},
                      "lora_dropout": 0.1, "objective": "sft", "lr": 1e-3}
    cfg = TrainConfig(**values)
    assert cfg.lora == LoRASettings(r=8, alpha=10.0, dropout=0.1)
    assert cfg.engine.kernels == "reference" and cfg.objective.name == "sft"
    path.write_text("objective:\n  name: sft\n  max-prompt-len: 32\n")
    assert load_yaml_config(str(path)) == {"objective": {"name": "sft", "max_prompt_len": 32}}


@pytest.mark.parametrize("text, expect", [
    ("lora:\n  rank: 8\n", "unknown option lora.rank; lora holds r, alpha, dropout, targets"),
    ("lora: 8\n", "option 'lora' must be a mapping of its settings (r, alpha,"),
    ("lora: {r: two}\n", "option 'lora.r' must be an integer, got 'two'"),
    ("beta: high\n", "option 'beta' must be a number"),
    ("precompute-reference: 1\n", "option 'precompute-reference' must be true or false"),
])
def test_yaml_section_errors_are_one_line(tmp_path, text, expect):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(LeantuneError) as e:
        load_yaml_config(str(path))
    assert str(e.value).startswith(f"{path}: ") and expect in str(e.value)


def one_line(capsys, *args) -> str:
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("leantune: error: ")
    return err[0]


def test_objective_flags(capsys):
    assert one_line(capsys, "--objective", "rlhf").endswith(
        "--objective rlhf: no such objective; the objectives are sft, dpo, orpo, simpo, kto, grpo")
    assert one_line(capsys, "--objective", "dop").endswith(
        "--objective dop: no such objective; did you mean dpo?; the objectives are sft, dpo, orpo, "
        "simpo, kto, grpo")
    assert "did you mean grpo?" in one_line(capsys, "--objective", "GRPO")
    assert "--beta is a preference-objective setting, and --objective sft (the default) has " \
           "none" in one_line(capsys, "--beta", "0.2")
    assert "--precompute-reference is a preference-objective setting" in one_line(
        capsys, "--objective", "sft", "--precompute-reference")
    # the preference objectives' settings are checked as flags
    for objective, args, expect in (
            ("dpo", ["--beta", "0"], "--beta must be positive, got 0.0"),
            ("orpo", ["--beta", "nan"], "--beta must be a finite number"),
            ("dpo", ["--loss-type", "kl"], "--loss-type must be one of sigmoid, ipo, hinge"),
            ("dpo", ["--label-smoothing", "0.7"], "--label-smoothing must be in [0, 0.5]"),
            ("kto", ["--undesirable-weight", "-1"], "--undesirable-weight must be positive"),
            ("simpo", ["--max-prompt-len", "64", "--max-seq-len", "64"],
             "--max-prompt-len must be a positive number of tokens under --max-seq-len 64, got 64"),
            # a setting of another objective: refused, never silently unused
            ("orpo", ["--loss-type", "ipo"],
             "--loss-type is a setting of --objective dpo or grpo, not of --objective orpo"),
            ("dpo", ["--simpo-gamma", "1"], "--simpo-gamma is a setting of --objective simpo"),
            ("dpo", ["--desirable-weight", "2"], "--desirable-weight is a setting of --objective kto"),
            ("simpo", ["--precompute-reference"], "--precompute-reference is a setting of "
                                                  "--objective dpo"),
            ("dpo", ["--loss-type", "ipo", "--label-smoothing", "0.1"],
             "--label-smoothing applies to --loss-type sigmoid, not ipo"),
            ("dpo", ["--train-on-inputs"], "--train-on-inputs is an SFT setting"),
            ("kto", ["--format", "alpaca"], "--format is an SFT setting")):
        assert expect in one_line(capsys, "--objective", objective, *args), (objective, args)
    cfg = TrainConfig(objective="dpo", beta=0.3, loss_type="hinge", precompute_reference=True,
                      max_prompt_len=16).validate()
    assert cfg.objective == ObjectiveSettings("dpo", 0.3, "hinge", 0.0, 0.5, 1.0, 1.0, True, 16)
    cfg = TrainConfig(objective="kto", desirable_weight=2.0, undesirable_weight=0.5).validate()
    assert (cfg.objective.desirable_weight, cfg.objective.undesirable_weight) == (2.0, 0.5)
    # beta and loss_type default by objective, resolved by validate(): TRL's for the preference
    # objectives (beta 0.1; the DPO loss then reads None as sigmoid), 0 and dapo for GRPO
    assert ObjectiveSettings() == ObjectiveSettings("sft", None, None, 0.0, 0.5, 1.0, 1.0,
                                                    False, None)
    for name in ("dpo", "orpo", "simpo", "kto"):
        o = TrainConfig(objective=name).validate().objective
        assert (o.beta, o.label_smoothing, o.simpo_gamma, o.desirable_weight,
                o.undesirable_weight) == (0.1, 0.0, 0.5, 1.0, 1.0), name
    o = TrainConfig(objective="grpo", reward=["builtin:exact-answer"]).validate().objective
    assert (o.beta, o.loss_type) == (0.0, "dapo")


def test_train_help_lists_the_objective_flags(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for flag in ("--objective", "--beta", "--loss-type", "--label-smoothing", "--simpo-gamma",
                 "--desirable-weight", "--undesirable-weight", "--precompute-reference",
                 "--max-prompt-len"):
        assert flag in text, flag
