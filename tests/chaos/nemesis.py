"""One fault at a time, each healed before the next: the nemesis of the replicated and cluster runs.

Both runs break machines of their own (simulated hosts, or whole nodes) that a
fault may leave paused, cut off or stopped. Between two faults the nemesis heals
what it broke and waits, bounded by `HEAL_TIMEOUT_S` (never a timing claim),
until the run says it is whole again (`healed`), so that no fault meets a second
one that the system does not promise to survive. A machine that exits on its
own was not a fault but a bug found: it is said, recorded, and restarted as a
supervisor would.

A run mixes this in before `ChaosRun` and supplies ``machines`` (each with
``name``, ``process``, ``crashed``, ``running``, ``paused``, ``link``,
``start()``, ``resume()``, ``last_words()``), ``FAULTS`` (kind -> weight),
``NOT_HEALED`` (what failed to come back, for the log), ``healed(admin)`` and
``_fault(kind, admin, rng)``.
"""

from __future__ import annotations

import random
import time

HEAL_TIMEOUT_S = 90.0


class OneFaultAtATime:
    FAULTS: dict[str, int] = {}
    NOT_HEALED = "the system did not heal"

    def revive_crashed(self) -> None:
        for machine in self.machines:
            if machine.crashed:
                code, words = machine.process.returncode, machine.last_words()
                self.event("host-crashed", machine.name, f"exit {code}: {words}")
                self.stats["crashes"].append({"host": machine.name, "exit": code, "last_words": words,
                                              "t_s": round((time.monotonic_ns() - self.origin_ns) / 1e9, 1)})
                self.log(f"chaos: {machine.name} CRASHED (exit {code}): {words}")
                self.actors.remember(machine.start())

    def wait_healed(self, admin, what: str) -> bool:
        started = time.monotonic()
        self.stats["heal_waits"] += 1
        while not self._stop_nemesis.is_set():
            if self.healed(admin):
                self.stats["heal_s_max"] = max(self.stats["heal_s_max"], round(time.monotonic() - started, 1))
                return True
            if time.monotonic() - started > HEAL_TIMEOUT_S:
                self.stats["heal_timeouts"] += 1
                self.event("not-healed", what, f"{self.NOT_HEALED} within {HEAL_TIMEOUT_S:.0f} s")
                self.log(f"chaos: {self.NOT_HEALED} within {HEAL_TIMEOUT_S:.0f} s after {what}")
                return False
            self._stop_nemesis.wait(0.2)
        return False

    def _nemesis(self) -> None:
        from zbroker.client import Admin

        cfg = self.config
        rng = random.Random(self.rng.randrange(1 << 32))
        end = time.monotonic() + cfg.duration_s
        kinds = [k for k, weight in self.FAULTS.items() for _ in range(weight)]
        admin = Admin(self.url, request_timeout=2.0)
        try:
            while not self._stop_nemesis.is_set() and time.monotonic() < end:
                if self._stop_nemesis.wait(rng.uniform(*cfg.nemesis_gap_s)):
                    break
                self.revive_crashed()
                kind = rng.choice(kinds)
                self.stats["nemesis_actions"] += 1
                self.stats[f"fault {kind}"] += 1
                try:
                    self._fault(kind, admin, rng)
                finally:
                    self.remember_actors()
                self.wait_healed(admin, kind)
        finally:
            admin.close()
            for machine in self.machines:  # whatever a stop left behind
                if machine.paused:
                    machine.resume()
                if machine.link.mode != "forward":
                    machine.link.restore()
                if not machine.running:
                    machine.start()
            self.remember_actors()
