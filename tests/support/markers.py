"""Marks several test modules share."""

import pytest

#: Frameworks warn about what the tests do on purpose (one-process DCP loads, deprecated Orbax
#: paths, read-only numpy views handed to torch); the tests check outcomes, not those warnings.
QUIET = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
