"""Why a pool's call failed, for the RankFailure it raises: which rank failed first and how (raised,
died and where, hung and where), which were stopped because of it, what the flight records say
about a hang, and whether the ranks can take the next call as they are.

    class RankPool(FailureDiagnosis): ...        # the pool's side: its processes and pipes

The methods read the pool's processes (_procs), pipes (_conns, _stacks, _recorders), world_size
and backend, and call its _receive and _kill.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Dict, List, Optional, Tuple

from ..errors import RankFailure
from .call_checks import pickled
from .rank_report import PEER_LOST, clean_stack, describe_exit, short, where_it_was

# After the first rank fails, how long the others get to report their own error (in checked
# mode every rank raises the same mismatch; all of their messages are worth showing).
FAILURE_GRACE_S = 3.0
STACK_DUMP_WAIT_S = 1.0
IN_STEP_TIMEOUT_S = 10.0  # the check after a failure is local to each rank: it answers at once or not at all


def world_sequence_number(env) -> Optional[int]:
    """The calls this rank has issued on the world's group (None where the backend keeps no count)."""
    import torch.distributed as dist

    try:
        return int(dist.group.WORLD._get_sequence_number_for_group())
    except (AttributeError, RuntimeError, NotImplementedError):
        return None




class FailureDiagnosis:
    """The failure report's part of RankPool."""

    def _death(self, rank: int) -> Tuple[str, str]:
        """How a dead rank ended and where, and the stack its faulthandler wrote as it died."""
        self._procs[rank].join(1.0)
        summary = describe_exit(self._procs[rank].exitcode)
        stack = clean_stack(self._read_crash_stack(rank))
        where = where_it_was(stack).replace("waiting in ", "in ", 1)
        if where:
            summary = summary.replace(" (", f" {where} (", 1) if " (" in summary else f"{summary} {where}"
        return summary, stack

    def _in_step(self) -> bool:
        """After a failure that every rank answered (each returned or raised, none died or hung):
        whether the ranks can take the next call as they are. Yes when every rank is alive and
        has issued as many calls on the world's group as the others (torch's sequence number: a
        collective or a send/recv counts on each rank it involves, so a rank that left an
        unmatched call behind shows it). Keeping the pool keeps a failing test cheap to re-run,
        as hypothesis does when it shrinks an example; any doubt (a backend without sequence
        numbers, a rank that does not answer at once) gives fresh ranks instead."""
        if not self._procs or not all(p.is_alive() for p in self._procs):
            return False
        try:
            payload = pickled(world_sequence_number, (), "the pool's check after a failure")
            self._send(payload)
            _, failures, _, _, pending = self._receive(IN_STEP_TIMEOUT_S, "loaded")
            if failures or pending:
                return False
            results, failures, _, _, pending = self._receive(IN_STEP_TIMEOUT_S, "ok")
        except (OSError, EOFError, ValueError):
            return False
        return not failures and not pending and len(set(results.values())) == 1 and None not in results.values()

    def _flight_records(self, where: Dict[int, str], pending: set) -> List[str]:
        """What the live ranks' flight records say (a rank that died is named as dead); with
        TORCH_FR_DUMP_TEMP_FILE set (torch's setting), the records are also written there."""
        from .. import flight_recorder  # here, not at the top: `python -m collectives.flight_recorder`
        # imports this package first, and runpy warns when the module it runs is already imported
        from ..flight_verdict import verdict
        records = flight_recorder.collect(self._recorders)
        dead = {r: describe_exit(p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None}
        ended = set(range(self.world_size)) - set(pending) - set(dead)  # returned or raised: in no collective now
        lines = verdict(records, where, ranks=range(self.world_size), dead=dead, ended=ended)
        if not lines and where and not any(records.values()):  # a hang, and nothing to judge it by: say so
            lines = [f"no live rank sent its record within {flight_recorder.ANSWER_WAIT_S:g} s "
                     f"({len(records)} answered, every answer empty)" if records else
                     f"no live rank sent its record within {flight_recorder.ANSWER_WAIT_S:g} s"]
        prefix = os.environ.get("TORCH_FR_DUMP_TEMP_FILE")
        if prefix:  # after the verdict, which a file that cannot be written must not replace
            try:
                flight_recorder.write(records, prefix, self.world_size)
            except OSError as exc:
                lines.append(f"could not write the records to {prefix}<rank>: {exc.strerror or exc}")
        return lines

    def _report_failure(self, what: str, timeout: float, failures: Dict[int, str], summaries: Dict[int, str],
                        order: List[int], pending: set) -> None:
        """Raise RankFailure: the first rank that failed on its own leads, then the others that
        failed, then those stopped because of it (hung past the grace period, or lost a peer)."""
        __tracebackhide__ = True
        # A rank that only lost its peer can report before the parent sees the peer's death (both
        # arrive in one wait, in no set order): lead with the first failure of its own.
        own = [r for r in order if not PEER_LOST.search(failures[r])]
        if own and own[0] != order[0]:
            order = [own[0]] + [r for r in order if r != own[0]]
        stopped: List[int] = []
        if pending:  # hung (timeout), or still busy after another rank failed
            stacks = self._dump_stacks(sorted(pending))
            where = {r: where_it_was(stacks.get(r, "")) for r in pending}
            if failures:
                why = f"was still running {FAILURE_GRACE_S:.0f} s after rank {order[0]} failed"
                stopped = sorted(pending)
            else:  # a timeout: ranks busy outside a collective are the likely cause
                why = f"did not finish within the {timeout:g} s timeout"
                order = sorted(pending, key=lambda r: (where[r].startswith("waiting in"), r))
                if not where[order[0]].startswith("waiting in"):
                    stopped = [r for r in order if where[r].startswith("waiting in")]
            for rank in sorted(pending):
                summaries[rank] = f"{why}: {where[rank]}" if where[rank] else why
                failures[rank] = f"rank {rank} {why}; its Python stack:\n{stacks.get(rank) or '(no stack captured)'}"
        # A rank whose connection to a dead or failed peer broke failed because of that peer.
        stopped += [r for r in order[1:] if r not in stopped and PEER_LOST.search(failures[r])]
        # A hang: what torch's flight records say, when the ranks keep them (TORCH_FR_BUFFER_SIZE).
        from ..flight_recorder import recording
        # Not in start-up: no group exists yet to have recorded anything, and waiting for records
        # that cannot come put "no live rank sent its record" before the error that stopped it.
        told = self._flight_records(where if pending else {}, pending) \
            if recording(self.backend) and what != "start-up" else []
        if pending or not self._in_step():
            self._kill()  # the next submit starts fresh ranks
        failed = [r for r in order if r not in stopped]
        first = order[0]
        lines = [f"flight recorder: {line}" for line in told] + [
                 f"rank {first} {summaries[first]}",
                 f"  in {what} (world_size={self.world_size}, backend={self.backend})"]
        others = [r for r in failed if r != first]
        if others:
            lines.append("  also: " + "; ".join(f"rank {r} {short(summaries[r])}" for r in others))
        if stopped:
            lines.append(f"  stopped because of it: rank(s) {sorted(stopped)}")
            lines += [f"    rank {r} {short(summaries[r])}" for r in sorted(stopped)]
        body = "\n".join(f"----- {failures[r]}".rstrip() for r in [*failed, *sorted(stopped)])
        if what == "start-up" and any("exited with code 1" in f for f in failures.values()):
            body += (
                "\nHint: the ranks are spawned, so each one imports your main module first; a script that "
                "calls collectives.run() must do it under `if __name__ == \"__main__\":` (the ranks' own "
                "error output, above this message, says more)."
            )
        raise RankFailure("\n".join(lines) + "\n" + body, failures, first=first, failed=failed, stopped=stopped)

    def _read_crash_stack(self, rank: int) -> str:
        """What a dead rank's faulthandler wrote into its stack pipe as a fatal signal hit it (empty
        for a rank that exited or was killed by SIGKILL)."""
        reader, raw = self._stacks[rank], b""
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        while time.monotonic() < deadline and reader.poll(0):
            try:
                chunk = os.read(reader.fileno(), 1 << 16)
            except OSError:
                break
            if not chunk:  # end of file: the rank is gone and everything it wrote is read
                break
            raw += chunk
        return raw.decode(errors="replace")

    # -- hang diagnosis ---------------------------------------------------------------------------
    def _dump_stacks(self, ranks: List[int]) -> Dict[int, str]:
        for rank in ranks:
            try:
                os.kill(self._procs[rank].pid, signal.SIGUSR1)  # faulthandler writes the stack
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        raw = {rank: b"" for rank in ranks}
        while time.monotonic() < deadline:
            readers = {self._stacks[r].fileno(): r for r in ranks}
            ready, _, _ = select.select(list(readers), [], [], max(0.0, deadline - time.monotonic()))
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                raw[readers[fd]] += chunk
            if all(raw.values()) and not ready:
                break
            if all(raw.values()):
                time.sleep(0.05)  # let the last threads' frames arrive
        return {rank: clean_stack(text.decode(errors="replace")) for rank, text in raw.items() if text}
