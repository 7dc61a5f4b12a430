"""A union-find over replicas: which of a stage's replicas have mixed, directly or not, since
they were last all connected (see :mod:`.connectivity`). Its own module because the shared state
(:mod:`.state`) holds one per stage and the connectivity rules read it.
"""

from __future__ import annotations

from collections.abc import Iterable


class DisjointSet:
    """Union-find over replicas (pipelines), counting its components as it merges."""

    def __init__(self, items: Iterable[int]):
        self.parent = {i: i for i in items}
        self.count = len(self.parent)

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, items: Iterable[int]) -> None:
        items = [i for i in items if i in self.parent]
        for other in items[1:]:
            a, b = self.find(other), self.find(items[0])
            if a != b:
                self.parent[a] = b
                self.count -= 1

    def components(self) -> int:
        return self.count

    def add(self, item: int, joining: int) -> None:
        """A new element, in the component of ``joining``."""
        self.parent[item] = self.find(joining)

    def copy(self) -> DisjointSet:
        out = DisjointSet([])
        out.parent, out.count = dict(self.parent), self.count
        return out

    def roots(self, items: Iterable[int]) -> set[int]:
        return {self.find(i) for i in items if i in self.parent}

    def connected_with(self, items: Iterable[int]) -> bool:
        """Whether merging ``items`` as one group would connect everything."""
        return self.count - max(0, len(self.roots(items)) - 1) <= 1
