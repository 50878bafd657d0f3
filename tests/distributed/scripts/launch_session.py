"""Train and evaluate in 1 process, then in 2 with gk.distributed.launch; print JSON results."""

from __future__ import annotations

import json
import signal
import sys

import workloads

from gpukit import distributed as dist

if __name__ == "__main__":
    single = {
        "weights": workloads.train(),
        "weights_with_an_empty_share": workloads.train(
            workloads.SAMPLES_WITH_AN_EMPTY_SHARE, momentum=0.9
        ),
        "logged_losses": workloads.train_and_log(workloads.SAMPLES_WITH_AN_EMPTY_SHARE)[1],
        "eval_ids": workloads.evaluate_ids(),
    }
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup
    before = [signal.getsignal(s) for s in signals]
    ranks = dist.launch(workloads.session, int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    kept = [signal.getsignal(s) for s in signals] == before
    print(json.dumps({"single": single, "ranks": ranks, "signal_handlers_kept": kept}))
