"""The bad-input catalogue (merger/attacks.py): every case refused with a message naming the
file, key and reason, or answered correctly; no raw exception, no hang."""
import pytest

from devtools import attacks, attacks_run


@pytest.mark.parametrize("case", attacks.CASES, ids=[c.name for c in attacks.CASES])
def test_catalogue(case, tmp_path):
    outcome = attacks_run.run_case(case, tmp_path)
    expected = "accepted" if case.refuse is None else "refused"
    assert outcome.verdict == expected, f"{case.name}: {outcome.verdict}: {outcome.detail}"


def test_unreadable_images_are_skipped_and_counted(tmp_path, caplog):
    case = next(c for c in attacks.CASES if c.name.startswith("a 20000"))
    with caplog.at_level("WARNING", logger="merger.data.folders"):
        assert attacks_run.run_case(case, tmp_path).verdict == "accepted"
    # the bomb, among the good images, counted in a warning naming its folder
    assert {m.rsplit(": ", 1)[1] for m in caplog.messages} == {"skipped 1 unreadable image(s)"}
