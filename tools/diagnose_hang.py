"""Which ranks did not reach which collective: reads the dumps a hung run wrote under run.dir/diagnostics/.

    python tools/diagnose_hang.py RUN_DIR            a few lines: where the ranks part, and why
    python tools/diagnose_hang.py RUN_DIR --stacks 2 rank 2's Python stacks (every thread)

Each rank that could wrote one dump when a collective timed out or its watchdog fired (operations/diagnostics.py):
its latest collectives with their sequence numbers (per group; sends and receives per peer), its layout
coordinates and the iteration. This compares them, group by group (a group is a name and its ranks, so each tp
group is its own):

- a rank behind the others on a group did not reach the collective they entered: it is blocked in another one,
  it went on past it (a skipped collective: a later iteration or phase of the loop), or it is stuck outside any
  collective (its main thread's innermost frames say where);
- at a sequence number where the members' calls differ (kind, bytes, iteration, phase), the ranks part there;
- a receive that waits for a send its peer never issued names that peer.

Limits: the dumps hold each rank's latest records (a ring, and the latest of each group and peer), so a parting
long before the hang may be out of sight; a rank that skipped one of two identical calls in a row is seen where
their successors differ; a rank killed before it wrote its dump is named as missing. Reads JSON only; nothing in
a dump is run. After a restart the dumps are in run.dir/diagnostics.N (read when diagnostics/ has none, and said
so); dumps of two attempts in one folder (each dump names its attempt) are said to be, and only the newest
attempt's are analysed. See docs/operations.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from operations.diagnostics import DumpJson, RecordJson, describe_rank, dumps_folder, read_dumps

REGION_ORDER = {"startup": 0, "boundary": 1, "train": 2, "report": 3, "eval": 4, "checkpoint": 5}
BLOCKED = ("waiting", "failed")
P2P_KINDS = ("send", "recv")


@dataclass
class RankDump:
    """One rank's dump, with the lookups the analysis needs."""

    raw: DumpJson
    rank: int = 0
    records: list[RecordJson] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rank = int(self.raw["rank"])
        self.records = sorted(self.raw["records"], key=lambda r: r["order"])

    @property
    def who(self) -> str:
        return describe_rank(self.rank, self.raw["coords"])

    def collectives(self, group: str) -> dict[int, RecordJson]:
        return {r["seq"]: r for r in self.records if r["group"] == group and r["kind"] not in P2P_KINDS}

    def transfers(self, group: str, kind: str, peer: int) -> dict[int, RecordJson]:
        return {r["seq"]: r for r in self.records if (r["group"], r["kind"], r["peer"]) == (group, kind, peer)}

    def blocked(self) -> RecordJson | None:
        """The call this rank was stuck in: the one that failed, else the latest it was waiting in."""
        failed = [r for r in self.records if r["state"] == "failed"]
        waiting = [r for r in self.records if r["state"] == "waiting"]
        stuck = failed or waiting
        return stuck[-1] if stuck else None

    def main_frames(self, count: int = 3) -> str:
        """The innermost `count` frames of the main thread's stack ("file:line in function < ...")."""
        main = next((ident for ident, name in self.raw.get("threads", {}).items() if name == "MainThread"), None)
        frames: list[str] = []
        inside = False
        for line in str(self.raw.get("stacks", "")).splitlines():
            if line.startswith(("Thread ", "Current thread ")):
                inside = main is not None and main in line
            elif inside and line.strip().startswith("File "):
                path, _, rest = line.strip()[len('File "') :].partition('", line ')
                number, _, function = rest.partition(" in ")
                frames.append(f"{_short(path)}:{number} in {function}")
        return " < ".join(frames[:count]) if frames else "unknown"


def _short(path: str) -> str:
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    return "/".join(path.split("/")[-2:])


def _sentence(text: str) -> str:
    """The first sentence of torch's error (gloo's messages go on with advice)."""
    return text.split(". ")[0][:160]


def position(record: RecordJson) -> tuple[int, int]:
    """Where in the loop a call was made: (iteration, phase), in the loop's order."""
    return record["iteration"], REGION_ORDER.get(record["region"], 0)


def describe(record: RecordJson, with_group: bool = True) -> str:
    peer = f" {'to' if record['kind'] == 'send' else 'from'} rank {record['peer']}" if record["peer"] >= 0 else ""
    group = f" on {record['group']}" if with_group else ""
    return (
        f"{record['kind']} #{record['seq']}{peer}{group} ({record['nbytes']} B, iteration {record['iteration']}, "
        f"{record['region']})"
    )


def ranks_text(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def why_behind(dump: RankDump, missing: RecordJson) -> tuple[bool, str]:
    """Why `dump`'s rank did not reach `missing` (a call its peers entered): (skipped it, the reason)."""
    blocked = dump.blocked()
    later = [r for r in dump.records if position(r) > position(missing)]
    if later:
        now = f"it is now in {describe(blocked)}" if blocked else f"its next call was {describe(later[0])}"
        return True, f"went on without it (skipped it): {now}"
    if blocked is not None:
        return False, f"it is blocked in {describe(blocked)}"
    last = dump.records[-1] if dump.records else None
    since = f"its last call {describe(last)} {last['state']}; " if last else ""
    return (
        False,
        f"it is stuck outside any collective ({dump.raw['cause']}: {since}main thread at {dump.main_frames()})",
    )


def group_instances(dumps: dict[int, RankDump]) -> dict[tuple[str, tuple[int, ...]], list[RankDump]]:
    """Every group (name, its ranks) of more than one rank, with the members that left a dump."""
    instances: dict[tuple[str, tuple[int, ...]], list[RankDump]] = {}
    for dump in dumps.values():
        for name, ranks in dump.raw["groups"].items():
            if len(ranks) > 1:
                instances.setdefault((name, tuple(ranks)), []).append(dump)
    return instances


def parting(name: str, ranks: tuple[int, ...], members: list[RankDump]) -> list[str]:
    """Findings on one group: the first sequence number where the members' calls differ, and members behind."""
    label = f"{name} [{ranks_text(list(ranks))}]"
    calls = {dump.rank: dump.collectives(name) for dump in members}
    common = sorted(set.intersection(*(set(c) for c in calls.values()))) if calls else []
    for seq in common:
        keys = {rank: tuple(calls[rank][seq][k] for k in ("kind", "nbytes", "iteration", "region")) for rank in calls}
        if len(set(keys.values())) > 1:
            usual = Counter(keys.values()).most_common(1)[0][0]
            odd = [rank for rank, key in keys.items() if key != usual]
            agree = [rank for rank, key in keys.items() if key == usual]
            return [
                f"the ranks part on {label} at #{seq}: ranks {ranks_text(agree)} issued "
                f"{describe(calls[agree[0]][seq], False)}; "
                + "; ".join(f"{dumps_who(members, rank)} issued {describe(calls[rank][seq], False)}" for rank in odd)
            ]
    tops = {rank: max(c) if c else -1 for rank, c in calls.items()}
    top = max(tops.values(), default=-1)
    ahead = [rank for rank, t in tops.items() if t == top]
    findings = []
    for dump in members:
        if tops[dump.rank] >= top or top < 0:
            continue
        missing = calls[ahead[0]].get(tops[dump.rank] + 1) or calls[ahead[0]][top]
        skipped, reason = why_behind(dump, missing)
        if skipped:
            findings.append(
                f"the ranks part on {label} at #{missing['seq']}: ranks {ranks_text(ahead)} entered "
                f"{describe(missing, False)}; {dump.who} {reason}"
            )
        else:
            findings.append(
                f"{dump.who} did not reach {describe(missing, False)} on {label}, which ranks {ranks_text(ahead)} "
                f"entered: {reason}"
            )
    return findings


def dumps_who(members: list[RankDump], rank: int) -> str:
    return next(dump.who for dump in members if dump.rank == rank)


def unsent(dumps: dict[int, RankDump]) -> list[str]:
    """Receives (sends) a rank waits in that its peer never posted."""
    findings = []
    for dump in dumps.values():
        blocked = dump.blocked()
        if blocked is None or blocked["kind"] not in P2P_KINDS or blocked["peer"] not in dumps:
            continue
        peer = dumps[blocked["peer"]]
        other = "send" if blocked["kind"] == "recv" else "recv"
        posted = peer.transfers(blocked["group"], other, dump.rank)
        if max(posted, default=-1) < blocked["seq"]:
            findings.append(
                f"{dump.who} waits in {describe(blocked)}; {peer.who} never posted its {other} #{blocked['seq']}: "
                f"{why_behind(peer, blocked)[1]}"
            )
    return findings


def analyse(raw_dumps: list[DumpJson]) -> list[str]:
    """The report's lines."""
    dumps = {dump.rank: dump for dump in map(RankDump, raw_dumps)}
    world = int(next(iter(dumps.values())).raw["world_size"])
    causes = Counter(dump.raw["cause"] for dump in dumps.values())
    iterations = sorted({dump.raw["iteration"] for dump in dumps.values()})
    lines = [
        f"{len(dumps)} of {world} ranks wrote a dump, at iteration {'/'.join(map(str, iterations))}: "
        + ", ".join(f"{count} {cause}" for cause, count in sorted(causes.items()))
    ]
    missing = [rank for rank in range(world) if rank not in dumps]
    if missing:
        lines.append(f"no dump from rank(s) {ranks_text(missing)}: killed or crashed before writing one (see the log)")
    for (name, ranks), members in sorted(group_instances(dumps).items()):
        lines += parting(name, ranks, members)
        if len(members) < len(ranks):
            waiting = [d.rank for d in members if (blocked := d.blocked()) is not None and blocked["group"] == name]
            absent = [rank for rank in ranks if rank not in dumps]
            if waiting:
                lines.append(
                    f"ranks {ranks_text(waiting)} wait on {name} for rank(s) without a dump: {ranks_text(absent)}"
                )
    lines += unsent(dumps)
    if len(lines) == 1 + bool(missing):
        lines.append("no rank is behind another on any group: every rank's latest calls match")
    where = []
    for dump in dumps.values():
        blocked = dump.blocked()
        state = f"in {describe(blocked)}: {_sentence(blocked['error']) or 'waiting'}" if blocked else "in no collective"
        where.append(f"  {dump.who}: {state}")
    return lines + ["where each rank was:"] + where


def _attempt_text(dumps: list[DumpJson]) -> str:
    first = dumps[0]
    if "run_started" not in first:
        return f"rank(s) {ranks_text([d['rank'] for d in dumps])} of an attempt that did not name itself (older dumps)"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first["run_started"]))
    return f"rank(s) {ranks_text([d['rank'] for d in dumps])} of the attempt {first.get('run')} started {started}"


def newest_attempt(raw: list[DumpJson], folder: str) -> tuple[list[DumpJson], str | None]:
    """The dumps of the newest attempt in `raw`, and a line saying which were left out when `raw` mixes the
    dumps of more than one attempt (a run id and start time in each dump; dumps without one count as older)."""
    attempts: dict[tuple[float, str], list[DumpJson]] = {}
    for dump in raw:
        attempts.setdefault((dump.get("run_started", float("-inf")), dump.get("run", "")), []).append(dump)
    if len(attempts) == 1:
        return raw, None
    order = sorted(attempts)
    newest = attempts[order[-1]]
    older = "; ".join(_attempt_text(attempts[key]) for key in order[:-1])
    return newest, (
        f"warning: {folder} mixes the dumps of {len(attempts)} attempts: analysing {_attempt_text(newest)}; "
        f"left out: {older}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="the run's run.dir (or its diagnostics/ folder)")
    parser.add_argument("--stacks", type=int, metavar="RANK", help="print this rank's Python stacks instead")
    args = parser.parse_args(argv)
    notes: list[str] = []
    try:
        folder, moved = dumps_folder(args.run_dir)
        raw = read_dumps(folder)
        raw, mixed = newest_attempt(raw, folder)
        notes = [note for note in (moved, mixed) if note]
        if args.stacks is not None:
            found = [dump for dump in raw if dump.get("rank") == args.stacks]
            if not found:
                raise ValueError(f"--stacks {args.stacks}: no dump from that rank in {args.run_dir}")
            for note in notes:  # which folder (and attempt) the stacks come from
                print(note, file=sys.stderr)
            print(found[0].get("stacks", ""), end="")
            return 0
        lines = analyse(raw)
    except (ValueError, KeyError, TypeError, StopIteration) as err:
        what = f"a dump lacks the field {err}" if isinstance(err, KeyError) else str(err)
        print(
            f"error: {args.run_dir}: {what}" if not str(err).startswith(args.run_dir) else f"error: {err}",
            file=sys.stderr,
        )
        return 2
    print("\n".join(notes + lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
