"""Running the bad-input catalogue (devtools/attacks.py): each case in a fresh folder under a time
limit (a hang is a finding, not a stuck test), its outcome sorted: refused as expected, accepted as
expected, wrong message, raw exception, or hang."""
from __future__ import annotations

import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from merger.errors import MergerError
from devtools.attacks import CASES, Case


# ---- running ----------------------------------------------------------------------------------

class Hang(Exception):
    pass


@dataclass
class Outcome:
    case: str
    verdict: str  # refused | accepted | wrong message | raw exception | hang | not refused
    detail: str
    seconds: float


def run_case(case: Case, root: Path, timeout: float = 20.0) -> Outcome:
    """Build and run one case under a time limit (SIGALRM: the main thread only)."""
    def on_alarm(signum, frame):
        raise Hang(f"no answer in {timeout:g} s")

    t0 = time.perf_counter()
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        action = case.build(root)
        action()
        verdict, detail = ("accepted", "") if case.refuse is None else ("not refused", "no error")
    except Hang as exc:
        verdict, detail = "hang", str(exc)
    except MergerError as exc:
        msg = str(exc)
        ok = case.refuse is not None and re.search(case.refuse, msg, re.S)
        verdict, detail = ("refused" if ok else "wrong message"), msg.splitlines()[0][:300]
    except Exception as exc:  # noqa: BLE001  the finding: a raw exception reached the user
        verdict, detail = "raw exception", f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Outcome(case.name, verdict, detail, time.perf_counter() - t0)


def run_catalogue(timeout: float = 20.0) -> tuple[list[Outcome], float]:
    """Every case in a fresh temporary folder; (outcomes, peak resident memory in GB)."""
    import tempfile

    from devtools.measure import reset_peak_rss, rss_gb

    reset_peak_rss()
    outcomes = []
    for case in CASES:
        with tempfile.TemporaryDirectory(prefix="merger-attack-") as tmp:
            outcomes.append(run_case(case, Path(tmp), timeout))
    return outcomes, rss_gb()[1]


def format_outcomes(outcomes: list[Outcome], peak_gb: float) -> str:
    lines = [f"{'case':<42}{'verdict':<16}{'s':>6}  message"]
    for o in outcomes:
        lines.append(f"{o.case[:41]:<42}{o.verdict:<16}{o.seconds:6.2f}  {o.detail[:110]}")
    count = lambda v: sum(o.verdict == v for o in outcomes)  # noqa: E731
    lines += ["", f"cases tried {len(outcomes)} · refused with a message {count('refused')} · accepted correctly "
              f"{count('accepted')} · wrong message {count('wrong message')} · not refused {count('not refused')} · "
              f"raw exceptions {count('raw exception')} · hangs {count('hang')} · peak RSS {peak_gb:.2f} GB"]
    return "\n".join(lines)
