"""`JoinedGrid` routes each message to the grid of its node, pushes the grid ahead first, and refuses shared ids.

Two `LocalGrid`s stand for the browsers' grid and the simulated devices beside them: each node answers with
its grid, node id and partition, and notes when it ran.
"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr", reason='Flower is not installed: pip install -e ".[fleet]" to run the fleet tests')

from flwr.app import ConfigRecord, Context, Message, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402

from ort_lightning.errors import ConfigurationError  # noqa: E402
from ort_lightning.fleet.engines.joined import JoinedGrid  # noqa: E402
from ort_lightning.fleet.engines.local import LocalGrid  # noqa: E402

FIRST = 2**60 + 1


def _app(tag: str, ran: list[str]) -> ClientApp:
    app = ClientApp()

    @app.query()
    def answer(message: Message, context: Context) -> Message:
        ran.append(tag)
        who = ConfigRecord({"grid": tag, "node": context.node_id, "partition": context.node_config["partition-id"]})
        return Message(RecordDict({"who": who}), reply_to=message)

    return app


def _query(nodes: list[int]) -> list[Message]:
    return [Message(RecordDict(), dst_node_id=node, message_type="query") for node in nodes]


def _who(reply: Message) -> tuple[str, int, int]:
    who = reply.content.config_records["who"]
    return str(who["grid"]), int(who["node"]), int(who["partition"])  # type: ignore[arg-type]


def test_each_message_reaches_its_nodes_grid_and_the_grid_ahead_runs_first() -> None:
    ran: list[str] = []
    grid = JoinedGrid(LocalGrid(_app("ahead", ran), nodes=2), LocalGrid(_app("here", ran), nodes=2, first_node=FIRST))
    nodes = list(grid.get_node_ids())
    assert nodes == [1, 2, FIRST, FIRST + 1]

    replies = list(grid.send_and_receive(_query([*reversed(nodes), 7]), timeout=30))
    assert ran == ["ahead", "ahead", "here", "here"]  # the messages came here-first
    answered = {reply.metadata.src_node_id: reply for reply in replies}
    assert sorted(answered) == [1, 2, 7, FIRST, FIRST + 1]
    assert answered[7].error.reason == "no node 7"  # a node neither grid holds: the grid ahead answers it
    assert {node: _who(answered[node]) for node in nodes} == {
        1: ("ahead", 1, 0), 2: ("ahead", 2, 1), FIRST: ("here", FIRST, 0), FIRST + 1: ("here", FIRST + 1, 1)}

    ids = list(grid.push_messages(_query([FIRST + 1, 2])))
    pulled = list(grid.pull_messages(ids))
    assert sorted(_who(reply) for reply in pulled) == [("ahead", 2, 1), ("here", FIRST + 1, 1)]
    assert sorted(reply.metadata.reply_to_message_id for reply in pulled) == sorted(ids)
    assert list(grid.pull_messages(ids)) == []  # each reply is handed out once


def test_grids_that_share_a_node_id_and_a_first_node_out_of_range_are_refused() -> None:
    app = _app("any", [])
    with pytest.raises(ConfigurationError, match=r"Node ids \[1, 2\] belong to both joined grids, so a message to one "
                       "cannot be routed; give the LocalGrid a first_node beyond"):
        JoinedGrid(LocalGrid(app, nodes=2), LocalGrid(app, nodes=3)).get_node_ids()
    with pytest.raises(ConfigurationError, match=r"Expected `first_node` from 1 to 18446744073709551614 \(Flower's "
                       r"node ids are unsigned 64-bit, 0 is the server's\), but got 0"):
        LocalGrid(app, nodes=2, first_node=0)
