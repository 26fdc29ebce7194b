"""A run's token counts as the model states them: the estimate of a prompt, and how a
run's end settles what its engine reported with what the node counted."""

from __future__ import annotations

import math

import pytest

from iop_trio.model import (
    CHARS_PER_TOKEN,
    RunSpec,
    Usage,
    estimate_prompt_tokens,
    prompt_bytes,
    settle_usage,
)


def test_a_prompt_is_estimated_from_its_utf8_bytes_rounded_up():
    assert CHARS_PER_TOKEN == 4
    assert estimate_prompt_tokens("") == 0
    assert estimate_prompt_tokens("a") == 1  # any prompt costs a token
    assert estimate_prompt_tokens("abcd") == 1
    assert estimate_prompt_tokens("abcde") == 2
    assert estimate_prompt_tokens("é") == 1  # two bytes
    assert estimate_prompt_tokens("日本語") == 3  # nine bytes: finer than Latin text
    assert estimate_prompt_tokens("abcdefgh", chars_per_token=2.5) == 4


def test_a_runs_prompt_counts_its_messages_and_their_roles():
    spec = RunSpec("echo/m", prompt="abcd", messages=(("user", "hello"), ("system", "x")))
    assert prompt_bytes(spec) == 4 + 4 + 5 + 6 + 1
    assert estimate_prompt_tokens(spec) == math.ceil(20 / 4)
    assert estimate_prompt_tokens(spec, chars_per_token=1) == 20


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, True])
def test_chars_per_token_must_be_a_finite_number_over_0(bad):
    with pytest.raises(ValueError, match="chars_per_token must be a number > 0"):
        estimate_prompt_tokens("abc", chars_per_token=bad)


def test_a_reported_count_is_kept_and_a_missing_one_is_the_nodes_marked_estimated():
    exact = settle_usage(Usage("stop", 5, 3), prompt=9, completion=7)
    assert exact == Usage("stop", 5, 3)
    assert not exact.estimated
    # Ollama before 0.2 leaves prompt_eval_count out when its cache held the prompt
    half = settle_usage(Usage("stop", None, 3), prompt=9, completion=7)
    assert half == Usage("stop", 9, 3, prompt_estimated=True)
    assert half.estimated
    # llama-cpp-python streams no usage; a cancelled or failed run has no report at all
    for reported in (Usage("stop"), None):
        counted = settle_usage(reported, prompt=9, completion=7)
        assert (counted.prompt_tokens, counted.completion_tokens) == (9, 7)
        assert counted.prompt_estimated and counted.completion_estimated


def test_a_usage_shows_what_is_estimated():
    assert repr(Usage("stop", 5, 3)) == "<Usage stop in=5 out=3>"
    assert repr(Usage("", 9, None, prompt_estimated=True)) == "<Usage in=9~ out=->"
