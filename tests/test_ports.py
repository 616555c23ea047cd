"""Ports that radixserve picks (`free_port`) and holds (`bind_socket`) before serving on them.

A CI run once lost a test's port to Ray: `free_port` asked the kernel for any free port, the
server started Ray, and Ray's metrics agent, which picks ports at random above a kernel-given
one, listened on it; /health then reached Ray's Prometheus exporter instead of radixserve.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from cluster_util import require_ray

from radixserve.ports import bind_socket, free_port
from tests.test_server_cli import REPO_ROOT


def ephemeral_range() -> tuple[int, int]:
    low, high = open("/proc/sys/net/ipv4/ip_local_port_range").read().split()
    return int(low), int(high)


def plain_bind_fails(port: int) -> bool:
    """Whether a bind of port on every address without SO_REUSEADDR fails (Ray's probe for a
    free port binds that way)."""
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return True
        return False


@pytest.mark.skipif(not os.path.exists("/proc/sys/net/ipv4/ip_local_port_range"), reason="Linux only")
def test_free_ports_lie_below_the_kernels_ephemeral_range_and_above_rays_worker_ports() -> None:
    low, _ = ephemeral_range()
    if low < 21000:
        pytest.skip(f"this kernel's ephemeral range starts at {low}: no room below it")
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports)
    assert len(ports) > 1  # picked at random, not the same port every time
    assert not any(plain_bind_fails(port) for port in ports)


def test_a_held_port_refuses_a_plain_bind_until_released() -> None:
    port = free_port()
    held = bind_socket("127.0.0.1", port)
    try:
        assert plain_bind_fails(port)
    finally:
        held.close()
    assert not plain_bind_fails(port)


def test_a_listening_port_cannot_be_held() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        with pytest.raises(OSError):
            bind_socket("127.0.0.1", listener.getsockname()[1])


def test_a_port_left_in_time_wait_can_be_held() -> None:
    """The last run's connections leave the port in TIME_WAIT for a minute; the server that
    follows binds with SO_REUSEADDR and would succeed, so the hold must not call it in use."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", free_port()))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        accepted.close()  # the server side closes first: its end of the connection waits
        client.close()
    assert plain_bind_fails(port)  # the TIME_WAIT is there
    bind_socket("127.0.0.1", port).close()


def test_a_local_ray_starts_while_the_servers_port_is_held() -> None:
    """`serve --replicas` holds its port from before Ray starts until Serve's proxy binds it:
    a plain bind made from inside ray.init (Ray's own probe binds that way) fails. Ray's start
    is replaced by that probe here, which then ends the command; the port is free again after."""
    require_ray()
    port = free_port()
    script = (
        "import socket, sys, ray\n"
        "from radixserve.cli import main\n"
        "def probe(*args, **kwargs):\n"
        "    with socket.socket() as s:\n"
        "        try:\n"
        "            s.bind(('', int(sys.argv[1])))\n"
        "            print('free during ray.init')\n"
        "        except OSError:\n"
        "            print('held during ray.init')\n"
        "    raise SystemExit(3)\n"
        "ray.init = probe\n"
        "main(['serve', '--replicas', '1', '--port', sys.argv[1], '--model', 'demo'])\n")
    done = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True, text=True,
                          cwd=REPO_ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "held during ray.init"
    assert not plain_bind_fails(port)


def test_malformed_keys_for_a_cluster_free_the_port_it_held() -> None:
    """`serve --replicas` holds its port first, then reads the keys: a malformed key is a
    one-line error, and the port is free again (in process: nothing here starts Ray)."""
    require_ray()
    from radixserve.cli import main

    port = free_port()
    assert main(["serve", "--replicas", "1", "--port", str(port), "--api-key", ""]) == 2
    assert not plain_bind_fails(port)


def test_a_busy_port_stops_serve_replicas_before_ray_starts() -> None:
    require_ray()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        script = ("import sys, ray; from radixserve.cli import main\n"
                  "code = main(['serve', '--replicas', '1', '--port', sys.argv[1], '--model', 'demo'])\n"
                  "print(ray.is_initialized(), 'torch' in sys.modules); sys.exit(code)\n")
        done = subprocess.run([sys.executable, "-c", script, str(port)], capture_output=True, text=True,
                              cwd=REPO_ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 1, done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout.strip() == "False False"  # said before Ray started, and before torch loaded


def test_the_port_hint_comes_only_with_a_port_in_use_and_a_bracketed_ipv6_host_is_taken() -> None:
    """A host that does not resolve was reported with "is another server using port N?"; an
    IPv6 literal written as in a URL ([::1]) was refused as a host name."""
    import contextlib
    import io

    from radixserve.cli import build_parser, main

    port = free_port()
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = main(["serve", "--port", str(port), "--host", "no-such-host.invalid"])
    assert code == 1
    (line,) = stderr.getvalue().splitlines()
    assert line.startswith(f"radixserve: error: cannot listen on no-such-host.invalid:{port}: ")
    assert "another server" not in line
    with bind_socket("127.0.0.1", port) as held:
        held.listen()
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            assert main(["serve", "--port", str(port)]) == 1
    assert stderr.getvalue().strip().endswith(f"(is another server using port {port}?)")
    parse = build_parser().parse_args
    assert parse(["serve", "--host", "[::1]"]).host == "::1"
    assert parse(["serve", "--host", "::1"]).host == "::1"
    assert parse(["serve", "--host", "0.0.0.0"]).host == "0.0.0.0"
