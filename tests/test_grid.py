"""The grid's building blocks: server start-up never hangs and never orphans a process; the leg plan alternates
arm order per rep; prompt partitions are disjoint across (concurrency, rep) and reproducible."""
import re
import sys
import time

import httpx
import pytest
from omegaconf import OmegaConf

from campaigns import grid
from campaigns.evidence import Arm
from helpers import alive

ARMS = [Arm("off", False, "baseline"), Arm("on", True, "candidate")]


def _start(tmp_path, code: str, timeout_s: float):
    cmd = [sys.executable, "-u", "-c", code]
    return grid.start_server(ARMS[0], cmd, str(tmp_path / "server.log"), env={}, timeout_s=timeout_s)


def test_silent_server_times_out_and_is_killed(tmp_path, monkeypatch):
    procs = []
    real_popen = grid.subprocess.Popen
    monkeypatch.setattr(grid.subprocess, "Popen", lambda *a, **k: procs.append(real_popen(*a, **k)) or procs[-1])
    t0 = time.monotonic()
    with pytest.raises(grid.GridError, match="not ready after 2 s"):
        _start(tmp_path, "import time; time.sleep(60)", timeout_s=2)
    assert time.monotonic() - t0 < 10
    assert procs[0].poll() is not None                    # killed, not left running


def test_server_that_exits_early_is_reported_with_its_log(tmp_path):
    with pytest.raises(grid.GridError, match="exited with 3") as e:
        _start(tmp_path, "print('loading failed: no such model'); raise SystemExit(3)", timeout_s=30)
    assert "no such model" in str(e.value)


def test_failure_after_the_ready_line_kills_the_server(tmp_path, monkeypatch):
    procs = []
    real_popen = grid.subprocess.Popen
    monkeypatch.setattr(grid.subprocess, "Popen", lambda *a, **k: procs.append(real_popen(*a, **k)) or procs[-1])
    # it claims to be ready on a port where nothing listens: /v1/models fails, the process must not survive
    code = "import time; print('vtengine serve: ready at http://127.0.0.1:9 (model x)', flush=True); time.sleep(60)"
    with pytest.raises(httpx.HTTPError):
        _start(tmp_path, code, timeout_s=30)
    assert procs[0].poll() is not None


def test_leg_plan_alternates_arm_order_per_rep():
    plan = grid.leg_plan(ARMS, [1, 2], reps=3, alternate=True)
    assert [(c, r, a.name) for c, r, a in plan[:4]] == [(1, 0, "off"), (1, 0, "on"), (2, 0, "off"), (2, 0, "on")]
    assert [(c, r, a.name) for c, r, a in plan[4:6]] == [(1, 1, "on"), (1, 1, "off")]
    assert len(plan) == 12 and len({(c, r, a.name) for c, r, a in plan}) == 12


def test_prompt_partitions_are_disjoint_and_reproducible():
    g = OmegaConf.create({"concurrency": [1, 2, 4], "reps": 2, "prompts_per_leg": [2, 3, 4], "input_len": 16,
                          "seed": 0, "warmup_requests": 1})
    parts, warm = grid.prompt_partitions(g, (16, 500))
    again, _ = grid.prompt_partitions(g, (16, 500))
    assert parts == again                                 # a resumed campaign sees the same prompts
    assert [len(parts[(c, r)]) for r in range(2) for c in (1, 2, 4)] == [2, 3, 4, 2, 3, 4]
    seen = [tuple(p) for ps in parts.values() for p in ps] + [tuple(p) for p in warm]
    assert len(seen) == len(set(seen))
    assert all(len(p) == 16 and all(16 <= t < 500 for t in p) for p in seen)
    # enough warm-up prompts to fill the largest concurrency; the measured partitions do not move with it
    assert len(warm) == 4
    wider, _ = grid.prompt_partitions(OmegaConf.merge(g, {"concurrency": [1, 2, 8]}), (16, 500))
    assert wider[(1, 0)] == parts[(1, 0)] and wider[(2, 1)] == parts[(2, 1)]


def test_output_len_partitions_follow_the_prompts_and_are_the_same_for_both_arms():
    """With output_len_range each leg's requests ask for their own lengths, drawn once per concurrency from the
    grid's seed and the same in every rep (reps stay replicates; a resumed campaign, and the other arm, ask for the
    same); without it one int a leg. The long-prompt grid varies them (64-192), so its closed-loop requests do not
    run in lockstep."""
    g = OmegaConf.create({"concurrency": [1, 2, 4], "reps": 2, "prompts_per_leg": [2, 3, 4], "output_len": 8,
                          "output_len_range": 0.5, "seed": 0})
    lens = grid.output_len_partitions(g)
    assert lens == grid.output_len_partitions(g)
    assert [len(lens[(c, r)]) for r in range(2) for c in (1, 2, 4)] == [2, 3, 4, 2, 3, 4]
    flat = [n for v in lens.values() for n in v]
    assert all(4 <= n <= 12 for n in flat) and len(set(flat)) > 2
    assert grid.output_len_partitions(OmegaConf.merge(g, {"output_len_range": 0.0})) == {
        (c, r): 8 for r in range(2) for c in (1, 2, 4)}
    from campaigns.config import compose
    long = compose(["campaign=mixed_prefill", "grid=long_prompt"], cuda=True).grid
    lens = grid.output_len_partitions(long)
    assert min(min(v) for v in lens.values()) >= 64 and max(max(v) for v in lens.values()) <= 192
    for c in (1, 2, 4):                                             # every rep of a point asks for the same
        assert all(lens[(c, r)] == lens[(c, 0)] for r in range(5)) and len(lens[(c, 0)]) == {1: 2, 2: 4, 4: 8}[c]
    assert lens[(2, 0)] != lens[(4, 0)][:4]                         # the points' draws are their own


def test_warmup_fills_the_leg_batch():
    warm = [[i] for i in range(8)]
    assert grid.warmup_for(warm, 1, 2) == [[0], [1]]
    assert grid.warmup_for(warm, 8, 2) == warm                  # c=8: eight warm-up requests, a batch of 8
    assert grid.warmup_for(warm, 4, 0) == []                    # warmup_requests 0: no warm-up at all


def test_stale_servers_of_an_earlier_run_are_stopped_by_their_pid_files(tmp_path):
    import json
    import subprocess
    import sys
    survivor_cmd = [sys.executable, "-c", "import time; time.sleep(120)"]
    survivor = subprocess.Popen(survivor_cmd)
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)  # not ours"])
    try:
        grid.write_pid_file(tmp_path / "server-on.pid", survivor.pid, survivor_cmd)
        # a pid file whose pid now belongs to another command (a recycled pid) must not be killed
        (tmp_path / "server-off.pid").write_text(json.dumps({"pid": bystander.pid, "cmd": survivor_cmd}))
        assert grid.stop_stale_servers(tmp_path, timeout_s=10) == [survivor.pid]
        assert survivor.wait(timeout=10) is not None and bystander.poll() is None
        assert not list(tmp_path.glob("*.pid"))
    finally:
        for p in (survivor, bystander):
            if p.poll() is None:
                p.kill()


def test_the_wide_grid_composes_plans_and_partitions():
    from campaigns.config import compose
    cfg = compose(["campaign=nsplits_cap", "grid=online_wide"], cuda=True)
    g = cfg.grid
    assert g.binding and list(g.concurrency) == [1, 2, 4, 8, 16, 32, 64, 128] and g.reps == 5
    assert all(n >= c for c, n in zip(g.concurrency, g.prompts_per_leg))   # every leg reaches its concurrency
    plan = grid.leg_plan(ARMS, list(g.concurrency), g.reps, g.alternate_order)
    assert len(plan) == 8 * 5 * 2 and len({(c, r, a.name) for c, r, a in plan}) == 80
    parts, warm = grid.prompt_partitions(OmegaConf.merge(g, {"input_len": 8}), (16, 500))
    assert {k: len(v) for k, v in parts.items() if k[1] == 0} == dict(zip(
        [(c, 0) for c in g.concurrency], g.prompts_per_leg))
    assert len(grid.warmup_for(warm, 128, g.warmup_requests)) == 128       # the c128 leg warms a batch of 128
    seen = [tuple(p) for ps in parts.values() for p in ps]
    assert len(seen) == len(set(seen)) == 5 * sum(g.prompts_per_leg)


@pytest.mark.parametrize("override,match", [
    (["grid.prompts_per_leg=[6,6,12,24,48,96,192,100]"], r"at least as many prompts as its concurrency.*c128 with 100"),
    (["grid.prompts_per_leg=[6,6]"], "must have one entry per"),
    (["grid.concurrency=[1,2,4,8,16,32,64,64]"], "repeats a value"),
    (["grid.output_len_range=1.0"], r"grid.output_len_range=1.0 with grid.output_len=128: range_ratio must be"),
    (["grid.output_len=4", "grid.output_len_range=0.75"], r"shortest 1; accepted: 0 <= r < 1"),
])
def test_the_wide_grid_refuses_a_malformed_override(override, match):
    from campaigns.config import CampaignConfigError, compose
    with pytest.raises(CampaignConfigError, match=match):
        compose(["campaign=nsplits_cap", "grid=online_wide"] + override, cuda=True)


def test_the_sampler_asks_nvml_for_the_gpu_cuda_sees_as_device_0():
    """NVML numbers every GPU of the host and ignores CUDA_VISIBLE_DEVICES: a sweep job pinned to GPU 3 must sample
    GPU 3's clocks, not GPU 0's; a UUID entry is looked up by UUID."""
    class Nvml:
        def nvmlDeviceGetHandleByIndex(self, i):
            return ("index", i)

        def nvmlDeviceGetHandleByUUID(self, u):
            return ("uuid", u)

    nv = Nvml()
    assert grid.nvml_handle(nv, {}) == ("index", 0)
    assert grid.nvml_handle(nv, {"CUDA_VISIBLE_DEVICES": "3,1"}) == ("index", 3)
    assert grid.nvml_handle(nv, {"CUDA_VISIBLE_DEVICES": "GPU-8f2e,GPU-11aa"}) == ("uuid", "GPU-8f2e")
    assert grid.nvml_handle(nv, {"CUDA_VISIBLE_DEVICES": ""}) == ("index", 0)


def test_the_servers_shut_down_together(tmp_path):
    """Each server gets SIGTERM before any is waited for: two that take 4 s each to shut down are gone in about 4 s,
    not 8, and leave no pid file."""
    import subprocess
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(4), sys.exit(0)))\n"
            "print('up', flush=True)\n"
            "time.sleep(120)\n")
    handles = []
    try:
        for arm in ARMS:
            proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, text=True)
            assert proc.stdout.readline().strip() == "up"        # its handler is set
            proc.stdout.close()
            log = str(tmp_path / f"server-{arm.name}.log")
            grid.write_pid_file(grid._pid_file(log), proc.pid, ["x"])
            handles.append(grid.ServerHandle(arm.name, "", proc, "", log))
        t0 = time.monotonic()
        grid.stop_servers(handles)
        took = time.monotonic() - t0
        assert [h.proc.returncode for h in handles] == [0, 0]   # shut down by their handler, not killed
        assert 3.9 < took < 7.0, took
        assert not list(tmp_path.glob("*.pid"))
    finally:
        for h in handles:
            if h.proc.poll() is None:
                h.proc.kill()
                h.proc.wait()


def test_a_server_that_ignores_sigterm_is_killed_at_the_deadline(tmp_path):
    import subprocess
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); "
            "time.sleep(120)")
    proc = subprocess.Popen([sys.executable, "-u", "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "up"
        proc.stdout.close()
        log = str(tmp_path / "server-on.log")
        grid.write_pid_file(grid._pid_file(log), proc.pid, ["x"])
        t0 = time.monotonic()
        grid.stop_servers([grid.ServerHandle("on", "", proc, "", log)], timeout_s=1.0)
        assert proc.returncode == -9 and time.monotonic() - t0 < 10
        assert not list(tmp_path.glob("*.pid"))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_restarted_server_appends_to_its_log(tmp_path):
    """A resume (or the next block of legs) starts an arm's server again: its log keeps the earlier start's output
    (what a void leg's message tells the user to read), each start under its own header."""
    with pytest.raises(grid.GridError, match="exited with 3"):
        _start(tmp_path, "print('first-start: CUDA out of memory'); raise SystemExit(3)", timeout_s=30)
    with pytest.raises(grid.GridError, match="exited with 3") as e:
        _start(tmp_path, "print('second-start failed: bad flag'); raise SystemExit(3)", timeout_s=30)
    # the error quotes this start's output alone: an earlier start's out-of-memory must not read as this one's
    assert "second-start failed" in str(e.value) and "first-start" not in str(e.value)
    assert not grid.out_of_memory(str(e.value))
    log = (tmp_path / "server.log").read_text()
    assert log.count("==== ") == 2 and log.index("first-start: CUDA") < log.index("second-start failed")


def test_a_server_is_killed_with_its_whole_session_and_a_failed_pid_file_leaves_no_orphan(tmp_path, monkeypatch):
    """_kill stops what the server started too (a worker process in its session), and a launch whose pid file
    cannot be written (a full disk) kills the process it just started: it is in no list the caller stops yet."""
    code = ("import subprocess, sys, time\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('worker', p.pid, flush=True)\n"
            "time.sleep(60)\n")
    launch = grid._launch(ARMS[0], [sys.executable, "-u", "-c", code], str(tmp_path / "server.log"), env={})
    deadline, found = time.monotonic() + 30, None
    while found is None and time.monotonic() < deadline:      # the header quotes the code: match the printed pid
        found = re.search(r"^worker (\d+)$", (tmp_path / "server.log").read_text(), re.M)
        time.sleep(0.1)
    worker = int(found.group(1))
    grid._kill(launch.proc)
    assert launch.proc.poll() is not None
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(worker), "the server's worker outlived it"
    # a graceful stop (SIGTERM, the server exits by itself) takes the session's workers with it too
    launch = grid._launch(ARMS[0], [sys.executable, "-u", "-c", code], str(tmp_path / "server2.log"), env={})
    deadline, found = time.monotonic() + 30, None
    while found is None and time.monotonic() < deadline:
        found = re.search(r"^worker (\d+)$", (tmp_path / "server2.log").read_text(), re.M)
        time.sleep(0.1)
    worker = int(found.group(1))
    grid.stop_servers([grid.ServerHandle("off", "", launch.proc, "", launch.log_path)], timeout_s=10)
    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert launch.proc.returncode == -15 and not alive(worker), "a stopped server's worker outlived it"

    procs = []
    real_popen = grid.subprocess.Popen
    monkeypatch.setattr(grid.subprocess, "Popen", lambda *a, **k: procs.append(real_popen(*a, **k)) or procs[-1])

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(grid, "write_pid_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        grid._launch(ARMS[1], [sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "b.log"), env={})
    assert procs[0].poll() is not None

