"""A math-verify worker: one JSON request per line on stdin, one answer per line on stdout.

Run by path (``python _math_worker.py``), so it imports only math-verify, not agentenv.
Request ``[given, expected]``; answer ``true``/``false`` (``false`` also when either side does
not parse). The parent kills a worker that overruns its deadline; EOF on stdin ends it.
"""

import json
import sys

from math_verify import parse, verify


def latex(s: str):
    s = s.strip()
    return parse(s if "$" in s or "\\boxed" in s else f"${s}$", parsing_timeout=None)


def equal(given: str, expected: str) -> bool:
    gold, pred = latex(expected), latex(given)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            given, expected = json.loads(line)
            answer = equal(str(given), str(expected))
        except Exception:  # noqa: BLE001 - an answer that breaks the parser is not equal
            answer = False
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
