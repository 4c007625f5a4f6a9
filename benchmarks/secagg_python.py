"""``python -m benchmarks.secagg_python``: what SecAgg+ costs a Python device (Flower's own mod), and the server.

The Python half of ``benchmarks.secagg``, on the same round: N devices, every one a neighbour of
every other (share number N, threshold N // 2 + 1, Flower's default ranges), run Flower's own
``SecAggPlusWorkflow`` over `LocalGrid` in this process. Each device's ClientApp is Flower's
``secaggplus_mod`` around a fit that answers at once with a fixed float32 update of 10 k, 100 k
or 1 M values; a mod outside it times one device's four stages (median of the rounds), and the
server's unmask stage (rebuilding the seeds, removing the masks, dequantizing) is timed apart.

Usage::

    python -m benchmarks.secagg_python                       # 10k, 100k, 1M values, 5 devices, 3 rounds
    python -m benchmarks.secagg_python --sizes 10000 --devices 3 --repeats 1
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

import numpy as np
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import SimpleClientManager
from flwr.server.compat.grid_client_proxy import GridClientProxy
from flwr.server.strategy import FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD

from ort_lightning.fleet import LocalGrid

STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")


def _client(size: int, times: dict[str, list[float]], sent: dict[str, int]) -> ClientApp:
    update = [np.sin(np.arange(size, dtype=np.float32)) * np.float32(0.1)]

    def timing(message: Message, context: Context, call_next: Any) -> Message:
        stage = str(message.content.config_records["secaggplus_configs"][Key.STAGE])
        started = time.perf_counter()
        reply: Message = call_next(message, context)
        if context.node_id == 1:
            times[stage].append((time.perf_counter() - started) * 1e3)
            configs = reply.content.config_records["secaggplus_configs"]
            sent[stage] = sum(len(item) for value in configs.values()
                              for item in (value if isinstance(value, list) else [value]) if isinstance(item, bytes))
        return reply

    app = ClientApp(mods=[timing, secaggplus_mod])

    @app.train()
    def fit(message: Message, context: Context) -> Message:
        fitres = FitRes(Status(Code.OK, ""), ndarrays_to_parameters(update), 30, {})
        return Message(compat.fitres_to_recorddict(fitres, keep_input=True), reply_to=message)

    return app


class _TimedUnmask(SecAggPlusWorkflow):
    """Flower's workflow, its unmask stage timed (the devices' replies to it are subtracted by the caller)."""

    seconds: list[float]

    def unmask_stage(self, grid: Any, context: Any, state: Any) -> bool:
        started = time.perf_counter()
        done = super().unmask_stage(grid, context, state)
        self.seconds.append(time.perf_counter() - started)
        return done


def measure(size: int, devices: int, repeats: int) -> dict[str, Any]:
    """One device's median milliseconds per stage, the server's unmask, and the bytes that device sends."""
    times: dict[str, list[float]] = {stage: [] for stage in STAGES}
    sent: dict[str, int] = {}
    grid = LocalGrid(_client(size, times, sent), nodes=devices)
    workflow = _TimedUnmask(num_shares=devices, reconstruction_threshold=devices // 2 + 1)
    workflow.seconds = []
    for _ in range(repeats):
        manager = SimpleClientManager()
        context = LegacyContext(Context(1, 0, {}, RecordDict(), {}), config=ServerConfig(num_rounds=1),
                                client_manager=manager,
                                strategy=FedAvg(min_fit_clients=devices, min_available_clients=devices))
        for node in grid.get_node_ids():
            manager.register(GridClientProxy(node, grid, run_id=1))
        context.state.config_records[MAIN_CONFIGS_RECORD] = ConfigRecord({"current_round": 1})
        start = ndarrays_to_parameters([np.zeros(size, np.float32)])
        context.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(start, keep_input=True)
        workflow(grid, context)
    unmask = [server * 1e3 - devices * device for server, device in zip(workflow.seconds, times["unmask"],
                                                                          strict=True)]
    return {"size": size, **{stage: statistics.median(times[stage]) for stage in STAGES},
            "server_unmask": statistics.median(unmask), "sent": sent}


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per size, one device's median milliseconds per stage, the server's unmask, the bytes sent."""
    lines = ["| where | values | setup (ms) | share keys (ms) | collect masked vectors (ms) | unmask (ms) | "
             "server's unmask (ms) | masked update (bytes) | plain float32 (bytes) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| Python (Flower's `secaggplus_mod`) | {row['size']:,} | {row['setup']:.1f} | "
                     f"{row['share_keys']:.1f} | {row['collect_masked_vectors']:.1f} | {row['unmask']:.2f} | "
                     f"{row['server_unmask']:.1f} | {row['sent']['collect_masked_vectors']:,} | {4 * row['size']:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000", help="update sizes, comma-separated")
    parser.add_argument("--devices", type=int, default=5, help="devices in the round, all neighbours")
    parser.add_argument("--repeats", type=int, default=3, help="rounds per size (the median is reported)")
    args = parser.parse_args()
    logging.getLogger("flwr").setLevel(logging.ERROR)
    rows = [measure(int(size), args.devices, args.repeats) for size in args.sizes.split(",")]
    print(f"load average {', '.join(f'{x:.1f}' for x in os.getloadavg())}; {args.devices} devices, "
          f"median of {args.repeats} rounds")
    print(table(rows))


if __name__ == "__main__":
    main()
