"""Where the tests read the handed cases: the repository's own copy under ``tests/cases/``.

The cases were handed in ``../shared/cases/`` (beside the checkout, absent on a user's clone);
``tests/unit/test_handed_cases_copy.py`` checks that this copy holds every one of them byte for byte
whenever ``../shared/`` is there, so a newly handed case cannot be missed.
"""

from __future__ import annotations

from pathlib import Path

#: The repository's copy of the handed cases (sse/, prometheus/, store/, multiturn/).
CASES = Path(__file__).resolve().parent / "cases"
#: The handed originals, present only where the project's shared folder sits beside the checkout.
SHARED_CASES = Path(__file__).resolve().parents[1].parent / "shared" / "cases"
