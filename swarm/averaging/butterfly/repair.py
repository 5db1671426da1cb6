"""Parts that nobody averaged are averaged again, among the members that are left (sans-I/O).

After the butterfly, a part whose owner lied (its average was refused), froze or died keeps each
member's own values. Every honest member sees the same failure, so each one plans the same
*repair*: one more all-reduce over those parts only, among the group minus their owners, under a
group id derived from the round's and from the failed parts. A member that saw no failure never
joins: the repair's streams name the round they repair, so once its round is over it refuses
them at once, the repairing members drop it at once, and the parts it would have owned keep
local values, as without a repair (a member that does not answer at all costs a short
deadline).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from swarm.averaging.butterfly.parts import PartPlan
from swarm.averaging.butterfly.staged import StagedAverages
from swarm.averaging.groups.group import GROUP_ID_BYTES, GroupInfo


@dataclass(frozen=True)
class Repair:
    """The repair of one round's failed parts, as this member plans it."""

    group: GroupInfo  # the round's members minus the failed parts' owners
    parts: tuple[int, ...]  # the round's failed parts, in order
    ranges: tuple[tuple[int, int], ...]  # their ranges in the round's vector
    numel: int  # the repair vector: those ranges one after the other

    @classmethod
    def plan(cls, group: GroupInfo, plan: PartPlan, me: int, done: set[int]) -> Repair | None:
        """The repair of the parts of ``plan`` not in ``done`` (this member's own part aside),
        or None when nothing failed or fewer than two members would be left."""
        failed = tuple(j for j in plan.owned() if j != me and j not in done)
        if not failed:
            return None
        keep = [i for i in range(len(group.members)) if i not in failed]
        if len(keep) < 2:
            return None
        tag = b"".join(j.to_bytes(2, "big") for j in failed)
        group_id = hashlib.sha256(b"repair" + group.group_id + tag).digest()[:GROUP_ID_BYTES]
        ranges = tuple(plan.ranges[j] for j in failed)
        return cls(group.subgroup(group_id, keep), failed, ranges, _total(ranges))

    def gather(self, flat: torch.Tensor) -> torch.Tensor:
        """This member's values of the failed parts, one after the other (a new tensor)."""
        return torch.cat([flat[start:end] for start, end in self.ranges])

    def repaired(
        self, sub_plan: PartPlan, sub_parts: dict[int, tuple[int, ...]], group: GroupInfo
    ) -> dict[int, tuple[int, ...]]:
        """The failed parts that the repair averaged whole: part -> contributors (indices in
        the round's ``group``), those that contributed to every repair part covering it."""
        index = {m.peer_id: i for i, m in enumerate(group.members)}
        out: dict[int, tuple[int, ...]] = {}
        offset = 0
        for part, (start, end) in zip(self.parts, self.ranges, strict=True):
            low, high = offset, offset + end - start
            offset = high
            covering = [
                r for r, (s, e) in enumerate(sub_plan.ranges) if e > s and s < high and e > low
            ]
            if not covering or any(r not in sub_parts for r in covering):
                continue
            common = set.intersection(*(set(sub_parts[r]) for r in covering))
            if len(common) > 1:
                out[part] = tuple(sorted(index[self.group.members[i].peer_id] for i in common))
        return out

    def stage(
        self,
        sub_staged: StagedAverages,
        sub_parts: Iterable[int],
        staged: StagedAverages,
        parts: set[int],
    ) -> None:
        """Stage the repaired ``parts`` in the round's ``staged``, from the repair's own
        (``sub_parts``: the repair's parts that averaged); a worker thread's work."""
        sub_result = torch.empty_like(sub_staged.flat)
        sub_staged.apply([sub_result], sub_parts)
        offset = 0
        for part, (start, end) in zip(self.parts, self.ranges, strict=True):
            if part in parts:
                staged.stage_values(part, start, sub_result[offset : offset + end - start])
            offset += end - start


def _total(ranges: tuple[tuple[int, int], ...]) -> int:
    return sum(end - start for start, end in ranges)
