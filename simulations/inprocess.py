"""An in-process Grid: the real ServerApp loop and the real ClientApp, without a SuperLink or Ray.

Messages are deep-copied on the way in and out (as serialisation would), and each node keeps its
own Context across rounds, as a SuperNode does. Clients run one after another in this process. Used
by the tests (so they can compare the SecAgg+ aggregate with the clients' plain updates) and by the
benchmark (so SecAgg+ overhead is measured without simulation-runtime noise). `flwr run` remains
the real thing; see simulations/.
"""

from __future__ import annotations

import copy
import time
import uuid
from typing import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp.grid import Grid
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity

from client.node_config import NUM_PARTITIONS_KEY, PARTITION_ID_KEY


class InProcessGrid(Grid):
    def __init__(
        self,
        client_app: ClientApp | Callable[[int], ClientApp],
        num_nodes: int,
        run_config: dict,
        node_configs: dict[int, dict] | None = None,
        run_id: int = 1,
    ) -> None:
        self._run = Run.create_empty(run_id)
        # Messages take their sender's identity from the process (set by Flower's runtime otherwise)
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, 0, 0
        self._apps = client_app
        self.contexts: dict[int, Context] = {}
        for partition in range(num_nodes):
            node_id = 1000 + partition
            node_config = {PARTITION_ID_KEY: partition, NUM_PARTITIONS_KEY: num_nodes}
            node_config.update((node_configs or {}).get(partition, {}))
            self.contexts[node_id] = Context(
                run_id=run_id, node_id=node_id, node_config=node_config, state=RecordDict(), run_config=dict(run_config)
            )
        self.client_seconds: dict[int, float] = {}

    def app_for(self, node_id: int) -> ClientApp:
        return self._apps(node_id) if callable(self._apps) and not isinstance(self._apps, ClientApp) else self._apps

    # -- Grid API
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return Message(content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        replies = []
        for msg in messages:
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                continue
            delivered = Message(metadata=copy.deepcopy(msg.metadata), content=copy.deepcopy(msg.content))
            delivered.metadata.__dict__["_message_id"] = uuid.uuid4().hex
            context = copy.deepcopy(self.contexts[node])  # kept only if the app succeeds, as in Flower
            started = time.perf_counter()
            try:
                reply = self.app_for(node)(delivered, context)
                reply = Message(metadata=copy.deepcopy(reply.metadata), content=copy.deepcopy(reply.content))
                self.contexts[node] = context
            except Exception as exc:  # noqa: BLE001 - a crashing client becomes an error reply, as in Flower
                reply = Message(
                    Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{type(exc).__name__}: {exc}"),
                    reply_to=delivered,
                )
            self.client_seconds[node] = self.client_seconds.get(node, 0.0) + time.perf_counter() - started
            replies.append(reply)
        return replies
