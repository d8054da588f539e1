"""Offline tokenizers for the data tests (built in tests/helpers.py)."""

import pytest

from helpers import END_TEMPLATE, EOS_TEMPLATE, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer(EOS_TEMPLATE)


@pytest.fixture(scope="session")
def end_tokenizer():
    return make_tokenizer(END_TEMPLATE)


@pytest.fixture(scope="session")
def plain_tokenizer():
    """No chat template."""
    return make_tokenizer(None)
