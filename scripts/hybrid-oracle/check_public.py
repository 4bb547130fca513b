"""Rerun each public hybrid case (<shared>/oracle/hybrid_v033.json) from its inputs through
hybrid.py and compare field by field with the published one.

  check_public.py [CASE_NAME ...]     (all public cases when none is named)

`note` and `model` are descriptions (the published `model` of the host-buffer cases is an
abbreviated one), so their differences are listed but do not count. Exit status 1 when some
case does not reproduce.
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hybrid as H  # noqa: E402

DESCRIPTIVE = (".note", ".model")


def diff(a, b, path=""):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in b:
                yield f"{path}.{k}: missing in rerun"
            elif k not in a:
                yield f"{path}.{k}: extra in rerun"
            else:
                yield from diff(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield f"{path}: len {len(a)} published vs {len(b)} rerun"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from diff(x, y, f"{path}[{i}]")
    elif a != b:
        yield f"{path}: published {a!r} vs rerun {b!r}"


def main(names):
    pub = json.load(open(os.path.join(H.SHARED, "oracle", "hybrid_v033.json")))
    bad = 0
    for pc in pub["cases"]:
        if names and pc["name"] not in names:
            continue
        try:
            mine = json.loads(json.dumps(H.rerun_public(pc)))
        except Exception as exc:  # noqa: BLE001
            bad += 1
            print(pc["name"], "ERROR", repr(exc))
            continue
        ds = list(diff(pc, mine))
        real = [d for d in ds if not d.startswith(DESCRIPTIVE)]
        desc = len(ds) - len(real)
        if real:
            bad += 1
            print(pc["name"], f"DIFFERS ({len(real)} fields)")
            for d in real[:15]:
                print("   ", d)
        else:
            print(pc["name"], "REPRODUCED" + (f" ({desc} descriptive fields differ)" if desc else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
