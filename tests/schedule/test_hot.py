"""`boogu_schedule.hot.per_iteration`: a mark that changes nothing when the function runs."""

from __future__ import annotations

import pytest

from boogu_schedule.hot import is_per_iteration, per_iteration, per_iteration_functions


def test_a_marked_function_is_itself_and_its_code_is_known():
    def body(x):
        return x + 1

    assert per_iteration(body) is body and body(1) == 2
    assert is_per_iteration(body.__code__)
    assert f"{__name__}:test_a_marked_function_is_itself_and_its_code_is_known.<locals>.body" in (
        per_iteration_functions()
    )

    def other():
        return None

    assert not is_per_iteration(other.__code__)
    with pytest.raises(TypeError, match="plain function"):
        per_iteration(staticmethod(other))
