"""Review finding: --no-shared-prompt given with an objective it does not apply to is refused,
but the one-line error tells the user to drop "--shared-prompt", a flag that does not exist
(the switch is on by default; only --no-shared-prompt is spelt)."""

import pytest

from leantune.cli import _config_from_args, build_parser
from leantune.errors import LeantuneError


@pytest.mark.parametrize("objective", ["kto", "sft", "grpo"])
def test_the_refusal_names_the_flag_that_was_given(objective):
    argv = ["train", "--model", "m", "--data", "d.jsonl", "--objective", objective,
            "--no-shared-prompt"]
    cfg = _config_from_args(build_parser().parse_args(argv))[0]
    with pytest.raises(LeantuneError) as e:
        cfg.validate()
    msg = str(e.value)
    assert "--no-shared-prompt" in msg
    assert "--shared-prompt" not in msg.replace("--no-shared-prompt", "")
    assert "\n" not in msg
