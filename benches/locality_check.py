"""The selection model's calibration check (:mod:`hisparse.tools.locality`): fit its two free parameters to two
of the paper's three hot-buffer miss rates (1x / 2x / 4x top_k rows: 30% / 13.4% / 6.7%), predict the third,
for each choice of the held-out point, from a generic start (sigma 1, drift 0.01). Prints one JSON line:

* ``points``: for each published miss rate, held out (the main check: fit 1x and 4x, predict 2x) or fitted, the
  published and the predicted value and the relative error;
* ``leave_one_out``: the same for the other two choices of the held-out point;
* ``overlap``: the overlap of consecutive positions' top-K (what sizes an MTP hot buffer), mean of the main fit,
  with its spread: ``sd_within`` over positions, ``range`` over the three leave-one-out fits;
* ``mtp3``: the rows an MTP3 step resolves (union of 4 consecutive positions) and the miss rates of buffers of
  1/2/4/5 x top_k rows over such steps (5 x top_k = the blog's ``(k + 2) * top_k``).

    python benches/locality_check.py            # ~1-2 minutes on 2 cores
"""

from __future__ import annotations

import json
import sys
import time

from hisparse.tools import locality


def main() -> int:
    t0 = time.monotonic()
    runs = {i: locality.check(held_out=i) for i in (1, 0, 2)}
    main_fit = runs[1]
    p = locality.Params(sigma=main_fit["sigma"], drift=main_fit["drift"])
    overlaps = [r["overlap"] for r in runs.values()]
    out = {
        "model": "hisparse.tools.locality",
        "fit": {"sigma": main_fit["sigma"], "drift": main_fit["drift"], "fitted_on": [1.0, 4.0]},
        "points": main_fit["points"],
        "leave_one_out": [{"held_out": r["held_out"], "sigma": r["sigma"], "drift": r["drift"],
                           "predicted": next(x["predicted"] for x in r["points"] if x["role"] == "held out"),
                           "rel_error": next(x["rel_error"] for x in r["points"] if x["role"] == "held out")}
                          for r in runs.values()],
        "overlap": {"mean": main_fit["overlap"], "sd_within": main_fit["overlap_sd"],
                    "range": [min(overlaps), max(overlaps)]},
        "mtp3": locality.mtp_rows(p, speculative=3),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
