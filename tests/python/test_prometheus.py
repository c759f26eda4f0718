"""gpu_arena.prometheus on the sim backend: the collector's names, types and help texts are
docs/metrics.md's table, and a real endpoint on localhost (served by a fresh process, scraped
with urllib, parsed with prometheus_client's parser) shows the values move with an
allocation. Needs prometheus_client (tests/python/requirements.txt)."""

from __future__ import annotations

import re
import subprocess
import urllib.request

import pytest
from conftest import REPO_DIR, finish, result_of, run_python, start_python
from result_channel import ReplyPipe

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import gpu_arena  # noqa: E402
from gpu_arena import prometheus as gp  # noqa: E402

TABLE = REPO_DIR / "docs" / "metrics.md"
MiB = 1 << 20


def table_rows():
    """(name, type, field, rust, help) of every row of docs/metrics.md's table."""
    rows = []
    for line in TABLE.read_text().splitlines():
        m = re.match(r"^\| `(gpu_arena_\w+)` \| (\w+) \| `(\w+)` \| (yes|no) \| (.+) \|$", line)
        if m:
            rows.append(m.groups())
    assert rows, f"no table rows in {TABLE}"
    return rows


def test_collector_is_the_table():
    assert [(m.name, m.type, m.field, m.help) for m in gp.METRICS] == [
        (name, kind, field, help) for name, kind, field, _rust, help in table_rows()
    ]
    described = {f.name: f for f in gp.GpuArenaCollector().describe()}
    for m in gp.METRICS:
        family = m.name[: -len("_total")] if m.type == "counter" else m.name
        assert described[family].type == m.type and described[family].documentation == m.help


def test_every_stat_has_a_metric_and_names_follow_conventions():
    assert sorted(m.field for m in gp.METRICS) == sorted(gpu_arena.GpuArenaStats().to_dict())
    for m in gp.METRICS:
        assert m.name.startswith("gpu_arena_")
        assert m.name.endswith("_total") == (m.type == "counter"), m.name
        assert m.field.endswith("_bytes") == m.name.endswith("_bytes"), m.name


def test_prometheus_client_is_imported_only_by_gpu_arena_prometheus():
    proc = run_python(
        """
        import sys, gpu_arena, gpu_arena.ipc
        from result_channel import report
        report("prometheus_client" in sys.modules)
        """
    )
    assert result_of(proc) is False


SERVER = """
import sys, gpu_arena, gpu_arena.prometheus as gp
from result_channel import reply_stream
replies = reply_stream()          # line buffered: each answer is flushed
gpu_arena.configure("backend=sim,arena_size=64MiB,grow_arenas=0,sim_devices=2,sim_capacity=1GiB")
server, _ = gp.start_http_server(0)
print("PORT=%d" % server.server_port, file=replies)
ptrs = []
for line in sys.stdin:            # one command per line, one answer each
    if line.strip() == "init":
        gpu_arena.init()
    elif line.strip() == "alloc":
        ptrs.append(gpu_arena.malloc(4 << 20, device=1))
    print("DONE", file=replies)
for p in ptrs:
    gpu_arena.free(p, 4 << 20, device=1)
server.shutdown()
"""


def scrape(port: int) -> dict:
    """{(sample name, device): value} from http://127.0.0.1:port/metrics, and the families."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode("utf-8")
    families = {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("gpu_arena_")}
    samples = {(s.name, s.labels.get("device")): s.value for f in families.values() for s in f.samples}
    return samples, families


def test_endpoint_on_localhost_moves_with_an_allocation():
    replies = ReplyPipe()
    try:
        proc = start_python(SERVER, env=replies.env, drop=("GPU_ARENA_CONF", "GPU_ARENA_BACKEND"),
                            stdin=subprocess.PIPE, bufsize=1, pass_fds=(replies.fd,))
    finally:
        replies.started()
    try:
        line = replies.reader.readline()
        assert line.startswith("PORT="), line
        port = int(line[len("PORT="):])

        def command(c):
            proc.stdin.write(c + "\n")
            proc.stdin.flush()
            assert replies.reader.readline().strip() == "DONE"

        before_init, families = scrape(port)
        assert before_init == {}, "no samples before init"
        assert {f.name for f in families.values()} == {
            m.name[: -len("_total")] if m.type == "counter" else m.name for m in gp.METRICS
        }
        command("init")
        before, families = scrape(port)
        for m in gp.METRICS:
            for device in ("0", "1"):
                assert (m.name, device) in before, (m.name, device)
            family = families[m.name[: -len("_total")] if m.type == "counter" else m.name]
            assert family.type == m.type and family.documentation == m.help
        command("alloc")
        after, _ = scrape(port)
        d1 = lambda name: after[(name, "1")] - before[(name, "1")]  # noqa: E731
        assert d1("gpu_arena_allocated_bytes") == 4 * MiB
        assert d1("gpu_arena_requested_bytes") == 4 * MiB
        assert d1("gpu_arena_allocations_live") == 1
        assert d1("gpu_arena_allocations_total") == 1
        assert d1("gpu_arena_reserved_bytes") == 64 * MiB
        assert d1("gpu_arena_arenas") == 1
        assert d1("gpu_arena_backend_creates_total") == 1
        assert after[("gpu_arena_peak_allocated_bytes", "1")] >= 4 * MiB
        assert {k: v for k, v in after.items() if k[1] == "0"} == {
            k: v for k, v in before.items() if k[1] == "0"
        }, "device 0 did not move"
    finally:
        done = finish(proc, timeout=30)  # closes stdin: the server frees and exits
        replies.close()
    assert done.returncode == 0, done.stdout + done.stderr


def test_register_once_per_registry():
    registry = prometheus_client.CollectorRegistry()
    assert gp.register(registry) is gp.register(registry)
    assert gp.register(prometheus_client.CollectorRegistry()) is not gp.register(registry)
