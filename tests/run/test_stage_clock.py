"""The step's stage clock: each lap's time goes to the stage named, DeepSpeed's reduction and the checkpoint saves
are stages of their own, the first step is left out of the steady means, and nothing is read from a device."""

from __future__ import annotations

import time

import pytest
import torch

from distaff.train.run.metrics import StageClock

pytestmark = pytest.mark.unit


class Engine:
    def allreduce_gradients(self):
        time.sleep(0.02)


class Saver:
    def save(self, step: int) -> str:
        time.sleep(0.03)
        return f"saved {step}"


def test_laps_reduction_and_saves_go_to_their_stages():
    clock, engine, saver = StageClock(torch.device("cpu")), Engine(), Saver()
    clock.watch_reduction(engine)
    clock.watch_saves(saver)
    for step in range(3):
        clock.start()
        time.sleep(0.01)
        clock.lap("data_wait")
        time.sleep(0.02 if step else 0.5)          # the first step pays for warm-up
        clock.lap("forward")
        time.sleep(0.01)
        engine.allreduce_gradients()               # inside engine.backward: its own stage
        clock.lap("backward")
        clock.lap("optimizer")
        clock.finish()
    assert saver.save(3) == "saved 3"
    steady, interval = clock.steady_means(), clock.report()
    stages = ("data_wait", "forward", "backward", "grad_comm", "optimizer", "other", "checkpoint")
    assert set(interval) == {f"{s}_s" for s in stages} | {f"{s}_cpu_s" for s in stages} | {"step_cpu_s"}
    assert interval["step_cpu_s"] < 0.05 < interval["forward_s"]          # sleeping takes wall time, not CPU
    assert steady["forward"] >= 0.02 and interval["forward_s"] > steady["forward"] + 0.05   # warm-up: interval only
    assert steady["grad_comm"] >= 0.02 and steady["backward"] >= 0.01 and steady["data_wait"] >= 0.01
    assert steady["checkpoint"] >= 0.03 / 2                                 # one save over the two steady steps
    assert clock.report()["forward_s"] == 0.0                               # reported: a new interval starts
