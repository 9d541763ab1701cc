"""What a worker's handlers share beyond the node's handles (api.node): its completion
queue and its link to the other nodes. The app builds each with only what it uses
(api.app.build_services); neither holds the node."""

from __future__ import annotations

from dataclasses import dataclass

from api.cluster import ClusterLink
from api.completions import CompletionQueue


@dataclass(frozen=True, eq=False)
class Services:
    completions: CompletionQueue
    cluster: ClusterLink  # the member list and the peers' client
