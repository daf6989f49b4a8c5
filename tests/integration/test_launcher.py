"""The launcher on its own: layout, exits reported at once, random faults, bad input."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from rank_runtime.launcher import layout, run
from schemas.common import Role
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.usefixtures("clean_stream")


def test_layout_deals_members_over_nodes_and_racks():
    slots = layout(nproc=4, spares=1, nodes=4, racks=2)
    assert [(s.member, s.node, s.rack, s.role) for s in slots] == [
        ("w0", "node0", "rack0", Role.WORKER),
        ("w1", "node1", "rack0", Role.WORKER),
        ("w2", "node2", "rack1", Role.WORKER),
        ("w3", "node3", "rack1", Role.WORKER),
        ("s0", "node0", "rack0", Role.SPARE),
    ]
    with pytest.raises(ValueError, match="racks <= nodes"):
        layout(2, 0, nodes=1, racks=2)


def test_a_launcher_per_node_names_its_members_after_the_node():
    slots = layout(2, 1, nodes=4, racks=2, node="job-worker-1", rack="rack1")
    assert [(s.member, s.node, s.rack, s.role) for s in slots] == [
        ("job-worker-1-w0", "job-worker-1", "rack1", Role.WORKER),
        ("job-worker-1-w1", "job-worker-1", "rack1", Role.WORKER),
        ("job-worker-1-s0", "job-worker-1", "rack1", Role.SPARE),
    ]
    with pytest.raises(ValueError, match="--rack goes with --node"):
        layout(2, 0, nodes=2, racks=1, rack="rack1")


async def test_exits_are_reported_and_random_faults_kill_a_worker(settings, pg_store, tmp_path):
    from tests.integration.helpers import running_controlplane

    script = tmp_path / "member.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        time.sleep(2.0)
        sys.exit(3 if os.environ["ELASTIC_MEMBER"] == "w1" else 0)
    """))  # fmt: skip
    async with running_controlplane(settings):
        import asyncio

        result = await asyncio.to_thread(
            run, [str(script)], nproc=3, job_id="job-launch", nats_url=settings.nats_url,
            fault_specs=["random:every=0.5:seed=3"],
        )  # fmt: skip
        await wait_until(
            lambda: len(pg_store.read(job_id="job-launch", types=["member.exited"])) == 3,
            10,
            "three exits reported",
        )
    assert len(result.killed) >= 1
    exited = {
        s.event.payload.member: s.event.payload
        for s in pg_store.read(job_id="job-launch", types=["member.exited"])
    }
    for member in result.killed:
        assert exited[member].signal == 9
    if "w1" not in result.killed:
        assert exited["w1"].exit_code == 3 and not result.ok


def test_the_cli_refuses_a_bad_fault_and_a_missing_script(tmp_path):
    script = tmp_path / "t.py"
    script.write_text("pass\n")
    bad = subprocess.run(
        [sys.executable, "-m", "controlplane", "run", "--fault", "explode@1:rank=0", str(script)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "expected crash@STEP" in bad.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "controlplane", "run", str(tmp_path / "nope.py")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert missing.returncode == 2 and "no training script" in missing.stderr


async def test_the_launcher_of_each_node_announces_its_members_and_reports_their_exits(
    settings, pg_store, tmp_path
):
    import asyncio

    from tests.integration.helpers import running_controlplane

    script = tmp_path / "member.py"
    script.write_text(textwrap.dedent(f"""
        import os, pathlib, time
        pathlib.Path({str(tmp_path)!r}, os.environ["ELASTIC_MEMBER"]).write_text(
            f"{{os.getpid()}} {{os.environ['ELASTIC_INCARNATION']}}")
        time.sleep(0.5)
    """))  # fmt: skip
    async with running_controlplane(settings):
        result = await asyncio.to_thread(
            run, [str(script)], nproc=2, spares=1, nodes=2, job_id="job-announce",
            nats_url=settings.nats_url,
        )  # fmt: skip
        await wait_until(
            lambda: len(pg_store.read(job_id="job-announce", types=["member.exited"])) == 3,
            10,
            "three exits reported",
        )
    assert result.ok
    log = pg_store.read(job_id="job-announce", types=["member.launched", "member.exited"])
    launched = {
        s.event.payload.member: (s.event.source, s.event.payload.role, s.event.payload.pid,
                                 s.event.payload.incarnation)
        for s in log
        if s.event.type == "member.launched"
    }  # fmt: skip
    # What each process saw: its pid, and the incarnation its launcher gave it.
    seen = {m: (tmp_path / m).read_text().split() for m in ("w0", "w1", "s0")}
    pid = {m: int(p) for m, (p, _) in seen.items()}
    incarnation = {m: i for m, (_, i) in seen.items()}
    assert len(set(incarnation.values())) == 3
    assert launched == {
        "w0": ("node0/launcher", Role.WORKER, pid["w0"], incarnation["w0"]),
        "w1": ("node1/launcher", Role.WORKER, pid["w1"], incarnation["w1"]),
        "s0": ("node0/launcher", Role.SPARE, pid["s0"], incarnation["s0"]),
    }
    # Each exit names the process that ended.
    exits = {
        s.event.payload.member: (s.event.source, s.event.payload.pid, s.event.payload.incarnation)
        for s in log
        if s.event.type == "member.exited"
    }
    assert exits == {
        "w0": ("node0/launcher", pid["w0"], incarnation["w0"]),
        "w1": ("node1/launcher", pid["w1"], incarnation["w1"]),
        "s0": ("node0/launcher", pid["s0"], incarnation["s0"]),
    }


def test_no_member_may_call_itself_launcher():
    from rank_runtime.identity import Identity, IdentityError

    env = {"ELASTIC_JOB_ID": "j", "ELASTIC_NODE": "n0", "ELASTIC_RACK": "r0"}
    assert Identity.from_env({**env, "ELASTIC_MEMBER": "w0"}).source == "n0/w0"
    with pytest.raises(IdentityError, match="reserved for the launcher"):
        Identity.from_env({**env, "ELASTIC_MEMBER": "launcher"})
