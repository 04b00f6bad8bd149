"""TLS, mutual TLS and the shared token, with a CA and certificates made at test time; refused
calls and streams are logged with the peer and the check that failed, and counted."""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest
import trustme

from gradserver.common.errors import InvalidArgumentError, UnauthenticatedError, UnavailableError
from gradserver.common.messages import ReduceOp, TensorKey
from gradserver.common.rpc import EXCHANGE_METHOD, stream_metadata
from gradserver.common.security import TlsFiles, bearer_metadata, is_loopback, token_matches
from gradserver.server.config import CoordinatorConfig
from gradserver.train.synthetic import SHAPES, run_exchange
from gradserver.worker import Timeouts, WorkerClient

from .helpers.logwait import log_waiter
from .helpers.processes import ROOT
from .helpers.raw import RawWorker, join
from .helpers.server import TEST_TIMEOUTS, run_each

QUICK = Timeouts(connect=2.0, join=20.0, receive=20.0, send=20.0, close=5.0)
TOKEN = "s3cret-token-value"


class Pki:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ca = trustme.CA()
        self.other_ca = trustme.CA()
        self.ca_file = self._write("ca.pem", self.ca.cert_pem.bytes())
        self.other_ca_file = self._write("other-ca.pem", self.other_ca.cert_pem.bytes())
        self.server = self._issue(self.ca, "server", "localhost", "127.0.0.1")

    def _write(self, name: str, data: bytes) -> str:
        path = self.tmp / name
        path.write_bytes(data)
        return str(path)

    def _issue(self, ca: trustme.CA, name: str, *identities: str, **kwargs: object) -> tuple[str, str]:
        cert = ca.issue_cert(*identities, common_name=name, **kwargs)
        return (
            self._write(f"{name}.crt", b"".join(p.bytes() for p in cert.cert_chain_pems)),
            self._write(f"{name}.key", cert.private_key_pem.bytes()),
        )

    def client(self, name: str, **kwargs: object) -> TlsFiles:
        cert, key = self._issue(self.ca, name, f"{name}.workers.test", **kwargs)
        tls = TlsFiles.load(self.ca_file, cert, key)
        assert tls is not None
        return tls


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path)


def _tls_server(coordinator, pki: Pki, *, mutual: bool = False, **extra):
    return coordinator(
        world_size=extra.pop("world_size", 1),
        tls_cert=pki.server[0],
        tls_key=pki.server[1],
        tls_client_ca=pki.ca_file if mutual else "",
        **extra,
    )


def _ca_only(path: str) -> TlsFiles:
    tls = TlsFiles.load(ca=path)
    assert tls is not None
    return tls


def test_tls_exchange_works_and_plaintext_or_wrong_ca_is_refused(coordinator, pki: Pki) -> None:
    server = _tls_server(coordinator, pki)
    with WorkerClient.connect(server.address, timeout=QUICK, tls=_ca_only(pki.ca_file)) as client:
        run_exchange(client, SHAPES["tiny"], 1)
    with pytest.raises(UnavailableError, match="cannot reach the coordinator"):
        WorkerClient.connect(server.address, timeout=QUICK)  # plaintext against TLS
    with pytest.raises(UnavailableError, match="TLS handshake may have failed"):
        WorkerClient.connect(server.address, timeout=QUICK, tls=_ca_only(pki.other_ca_file))


def test_mutual_tls_needs_a_valid_client_certificate(coordinator, pki: Pki) -> None:
    server = _tls_server(coordinator, pki, mutual=True)
    with pytest.raises(UnavailableError):
        WorkerClient.connect(server.address, timeout=QUICK, tls=_ca_only(pki.ca_file))  # no client cert
    expired = pki.client(
        "old-worker",
        not_before=datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC),
        not_after=datetime.datetime(2021, 1, 1, tzinfo=datetime.UTC),
    )
    with pytest.raises(UnavailableError):
        WorkerClient.connect(server.address, timeout=QUICK, tls=expired)
    with WorkerClient.connect(server.address, timeout=QUICK, tls=pki.client("worker-a")) as client:
        run_exchange(client, SHAPES["tiny"], 1)


def test_the_library_reads_the_token_from_the_environment_as_the_cli_does(coordinator, monkeypatch) -> None:
    server = coordinator(world_size=1, auth_token=TOKEN)
    monkeypatch.setenv("GRADSERVER_AUTH_TOKEN", TOKEN)
    with WorkerClient.connect(server.address, timeout=QUICK) as client:
        run_exchange(client, SHAPES["tiny"], 1)
    # An explicit token (even none) wins over the variable.
    with pytest.raises(UnauthenticatedError, match="missing or wrong auth token"):
        WorkerClient.connect(server.address, timeout=QUICK, auth_token="")


def test_token_is_required_checked_and_never_logged(coordinator, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    server = coordinator(world_size=1, auth_token=TOKEN)
    with pytest.raises(UnauthenticatedError, match="missing or wrong auth token") as info:
        WorkerClient.connect(server.address, timeout=QUICK)
    assert isinstance(info.value, PermissionError)
    with pytest.raises(UnauthenticatedError):
        WorkerClient.connect(server.address, timeout=QUICK, auth_token="wrong")
    with WorkerClient.connect(server.address, timeout=QUICK, auth_token=TOKEN) as client:
        run_exchange(client, SHAPES["tiny"], 1)
    assert TOKEN not in caplog.text
    assert TOKEN not in repr(server.config)
    # Health checks stay open for probes.
    cli = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "health", server.address],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert cli.returncode == 0


def test_a_worker_cannot_act_under_another_workers_id(coordinator, pki: Pki, caplog) -> None:
    """Mutual TLS plus token: worker B, holding worker A's id and member token, is refused (and
    the refusal is logged with the peer and both certificate names)."""
    caplog.set_level(logging.INFO)
    server = _tls_server(coordinator, pki, mutual=True, world_size=2, auth_token=TOKEN)
    tls_a, tls_b = pki.client("worker-a"), pki.client("worker-b")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [
            pool.submit(WorkerClient.connect, server.address, timeout=QUICK, tls=tls, auth_token=TOKEN)
            for tls in (tls_a, tls_b)
        ]
        a, b = (f.result(30) for f in futures)
    try:
        stolen = a._accepted  # what B would have to steal to impersonate A
        credentials = grpc.ssl_channel_credentials(tls_b.ca, tls_b.key, tls_b.cert)
        with grpc.secure_channel(server.address, credentials) as channel:
            call = channel.stream_stream(EXCHANGE_METHOD)(
                iter(()),
                metadata=stream_metadata(stolen.worker_id, stolen.session_id, stolen.member_token)
                + bearer_metadata(TOKEN),
            )
            with pytest.raises(grpc.RpcError) as info:
                list(call)
        assert info.value.code() is grpc.StatusCode.PERMISSION_DENIED
        assert "worker-a" in info.value.details() and "worker-b" in info.value.details()
        refusals = [r.getMessage() for r in caplog.records if "refused an Exchange" in r.getMessage()]
        assert len(refusals) == 1 and "ipv4:127.0.0.1:" in refusals[0], refusals
        assert f"certificate 'worker-b' does not match worker {stolen.worker_id}'s 'worker-a'" in refusals[0]
        assert TOKEN not in caplog.text
        run_each([a, b], lambda c: run_exchange(c, SHAPES["tiny"], 1))  # the real pair still works
    finally:
        a.close()
        b.close()


def test_safe_defaults_refuse_an_open_bind_without_protection() -> None:
    with pytest.raises(InvalidArgumentError, match="add --tls-cert/--tls-key or --auth-token, or --insecure"):
        CoordinatorConfig(bind="0.0.0.0:50051")
    assert CoordinatorConfig(bind="0.0.0.0:50051", insecure=True).insecure
    assert CoordinatorConfig(bind="0.0.0.0:50051", auth_token="t").auth_token == "t"
    assert CoordinatorConfig().bind.startswith("127.0.0.1:")
    with pytest.raises(InvalidArgumentError, match="--tls-cert and --tls-key go together"):
        CoordinatorConfig(tls_cert="a.pem")
    with pytest.raises(InvalidArgumentError, match="needs --tls-cert"):
        CoordinatorConfig(tls_client_ca="ca.pem")
    result = subprocess.run(
        [sys.executable, "-m", "gradserver.cli", "coordinator", "--bind", "0.0.0.0:0"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    shown = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradserver.cli",
            "coordinator",
            "--print-config",
            "--auth-token",
            TOKEN,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    assert "auth_token = '***'" in shown.stdout and TOKEN not in shown.stdout


def test_security_helpers() -> None:
    assert token_matches([("authorization", "Bearer abc")], "abc")
    assert not token_matches([("authorization", "Bearer abd")], "abc")
    assert not token_matches([("authorization", "abc")], "abc") and not token_matches(None, "abc")
    assert is_loopback("127.0.0.1") and is_loopback("[::1]") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3") and not is_loopback("example.org")
    with pytest.raises(InvalidArgumentError, match="cannot be read"):
        TlsFiles.load(ca="/nonexistent/ca.pem")


def test_auth_refusals_are_logged_with_peer_and_check_and_counted(coordinator) -> None:
    token = "s3cret-token-value"
    server = coordinator(world_size=1, auth_token=token, heartbeat_timeout=60.0)
    quick = TEST_TIMEOUTS
    with log_waiter() as logs:
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            WorkerClient.connect(server.address, timeout=quick)
        with pytest.raises(Exception, match="UNAUTHENTICATED"):
            WorkerClient.connect(server.address, timeout=quick, auth_token="wrong")
        # A worker's first call is the link probe before its Join.
        missing = logs.wait_for(r"refused a call from ipv4:127\.0\.0\.1:\d+: .*/Probe: missing auth token")
        wrong = logs.wait_for(r"refused a call from ipv4:127\.0\.0\.1:\d+: .*/Probe: wrong auth token")
        messages = logs.messages()
    assert missing.levelno == wrong.levelno == logging.WARNING
    assert not any(token in m for m in messages)
    assert not any("Bearer" in m for m in messages)
    count = server.call(
        lambda s: s.metrics.registry.get_sample_value("gradserver_errors_total", {"code": "UNAUTHENTICATED"})
    )
    assert count == 2


def test_a_stream_with_a_wrong_member_token_is_logged(coordinator) -> None:
    server = coordinator(world_size=1, heartbeat_timeout=60.0)
    with log_waiter() as logs:
        channel, accepted = join(server.address)
        try:
            from gradserver.common.rpc import stream_metadata

            intruder = RawWorker(
                channel,
                accepted,
                metadata=stream_metadata(accepted.worker_id, accepted.session_id, accepted.member_token + 1),
            )
            assert isinstance(intruder.recv(20), grpc.RpcError)
            logs.wait_for(r"refused an Exchange from ipv4:127\.0\.0\.1:\d+: worker 0 is not a member")
        finally:
            channel.close()


def test_host_groups_sum_under_mutual_tls_and_a_token(coordinator, pki: Pki) -> None:
    """Each member keeps its own authenticated stream; the group's memory goes only to members
    that learned its key over that TLS Join (and are this user)."""
    server = _tls_server(coordinator, pki, mutual=True, world_size=4, auth_token=TOKEN)
    hosts = ("host-a", "host-a", "host-b", "host-b")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [
            pool.submit(
                WorkerClient.connect,
                server.address,
                timeout=QUICK,
                tls=pki.client(f"worker-{rank}"),
                auth_token=TOKEN,
                rank=rank,
                host_id=host,
            )
            for rank, host in enumerate(hosts)
        ]
        clients = [f.result(30) for f in futures]
    try:
        assert [c.host_group for c in clients] == [(0, 1), (0, 1), (2, 3), (2, 3)]
        key = TensorKey.collective(0, 0, ReduceOp.SUM)
        got = run_each(clients, lambda c: c.collective(key, np.full(8, c.worker_id + 1.0, np.float32)).copy())
        for result in got:
            np.testing.assert_array_equal(result, np.full(8, 10.0, np.float32))
    finally:
        for client in clients:
            client.close()
