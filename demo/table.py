"""The demo's output: one table row per training step, printed as it completes."""

from __future__ import annotations

from collections.abc import Callable

from demo.trainer import Rollout, StepResult

HASH_CHARS = 8


def shown(text: str) -> str:
    """``text`` quoted on one line: anything but printable ASCII becomes ``.``."""
    return "'" + "".join(c if " " <= c <= "~" else "." for c in text) + "'"


def shown_tokens(ids: list[int], decode: Callable[[list[int]], str]) -> str:
    """Generated tokens quoted, decoded one at a time so that a token that is not
    text on its own (a stray byte of a random model) still takes one column."""
    return shown("".join(decode([i]) or "." for i in ids))


def matched(rollout: Rollout, target_ids: list[int]) -> str:
    hits = sum(a == b for a, b in zip(rollout.output_ids, target_ids, strict=False))
    return f"{hits}/{len(target_ids)}"


class StepTable:
    """Columns: the rollout the fleet produced before the step (and the version
    that produced it), the training loss, the version the step was synced as,
    the sync's wall time, and the trainer's checksum next to each worker's (all
    must be equal)."""

    def __init__(self, target_ids: list[int], worker_names: dict[str, str], decode: Callable[[list[int]], str]):
        self.target_ids = target_ids
        self.names = worker_names
        self.decode = decode
        self.init_seconds: float | None = None
        text_width = len(shown_tokens(target_ids, decode))
        served_width = len(" ".join(worker_names.values()))
        self.columns = [  # (title, width, alignment)
            ("step", 5, ">"),
            ("rollout (greedy)", text_width, "<"),
            ("served by", served_width, "<"),
            ("weight_version", 0, "<"),
            ("match", 5, ">"),
            ("loss", 6, ">"),
            ("synced as", 9, "<"),
            ("sync", 8, ">"),
            ("checksums: trainer = " + " = ".join(worker_names.values()), 0, "<"),
        ]

    def _line(self, *cells: str) -> str:
        return "  ".join(
            f"{cell:{align}{max(width, len(title))}}"
            # The final row has no sync cells: it fills the first columns only.
            for cell, (title, width, align) in zip(cells, self.columns, strict=False)
        ).rstrip()

    def _rollout_cells(self, label: str, rollouts: list[Rollout]) -> list[str]:
        first = rollouts[0]
        served = " ".join(self.names.get(r.worker, r.worker) for r in rollouts)
        return [
            label,
            shown_tokens(first.output_ids, self.decode),
            served,
            first.weight_version,
            matched(first, self.target_ids),
        ]

    def _disagreements(self, rollouts: list[Rollout]) -> None:
        first = rollouts[0]
        for r in rollouts[1:]:
            if r.output_ids != first.output_ids:
                note = (
                    f"{self.names.get(r.worker, r.worker)} DISAGREES with {self.names.get(first.worker, first.worker)}"
                )
                print(self._line("", shown_tokens(r.output_ids, self.decode), note))

    def header(self) -> None:
        print(self._line(*(title for title, _, _ in self.columns)))

    def row(self, result: StepResult) -> None:
        sync = result.sync
        mark = " "
        if "init_group" in sync.stage_seconds and sync.world_size is not None:  # this sync created the group
            self.init_seconds = sync.stage_seconds["init_group"]
            mark = "*"
        sums = [result.trainer_checksum] + [c for w in self.names for c in sync.rank_checksums.get(w, ["(none)"])]
        checks = " = ".join(s[:HASH_CHARS] for s in sums) + ("  ok" if len(set(sums)) == 1 else "  MISMATCH")
        cells = self._rollout_cells(str(result.step), result.rollouts)
        print(self._line(*cells, f"{result.loss:.3f}", sync.weight_version or "", f"{sync.seconds:.3f}s{mark}", checks))
        self._disagreements(result.rollouts)

    def final(self, rollouts: list[Rollout]) -> None:
        print(self._line(*self._rollout_cells("after", rollouts)))
        self._disagreements(rollouts)

    def footnotes(self) -> None:
        if self.init_seconds is not None:
            print(f"  * includes the one-time weight-update group init through the router ({self.init_seconds:.3f}s)")
