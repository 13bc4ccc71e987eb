"""Who may talk to the serving plane's ZeroMQ sockets, and where they may listen.

Every socket of the KV events (:mod:`jaxkv.serving.kv_events`) and of the routing
plane (:mod:`jaxkv.fleet`) is made by a :class:`SecureContext`:

- **Authentication.** With :class:`CurveKeys`, every socket uses ZeroMQ's CURVE: the
  binding side is the CURVE server, the connecting side a client, and a ZAP handler
  (pyzmq's ``zmq.auth`` thread) admits only the deployment's client key. One server
  key pair and one client key pair serve a deployment (replicas, routers,
  subscribers); they come from a directory of ``zmq.auth`` certificate files
  (``server.key_secret``, ``client.key_secret``: :meth:`CurveKeys.write` makes them),
  named by the argument or by the environment variable ``JAXKV_CURVE_DIR``.
- **On by default for tcp.** A ``tcp://`` endpoint without keys is refused
  (:class:`SocketSecurityError`) unless the caller asks for plaintext
  (``plaintext_tcp=True``, loopback only, e.g. for a vLLM router that cannot speak
  CURVE); ``ipc://`` paths and ``inproc://`` may go without keys (the file system and
  the process guard them) and use them when given. Abstract-namespace ipc
  (``ipc://@name``) has no file and no permissions, so any local user could connect:
  it is refused without keys, like tcp.
- **Where to listen.** A plaintext tcp bind must name a loopback host; an ``ipc://``
  path that a live socket holds is refused instead of silently taken over (a stale
  file from a dead process is replaced).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from jaxkv.errors import JaxkvError

ENV_CURVE_DIR = "JAXKV_CURVE_DIR"
"""The environment variable naming the deployment's certificate directory."""
SERVER_CERT = "server"
CLIENT_CERT = "client"
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
ABSTRACT_IPC = "ipc://@"
"""The prefix of Linux abstract-namespace ipc endpoints (no file behind them)."""
LOOPBACK_NAMES = ("localhost",)


class SocketSecurityError(JaxkvError, ValueError):
    """A socket would run unauthenticated where it must not, bind where it may not, or
    the keys are unusable; nothing was opened."""


def check_endpoint(name: str, endpoint: object) -> str:
    """``endpoint`` if it is a ZeroMQ address the serving plane may use, else :class:`SocketSecurityError`."""
    if not isinstance(endpoint, str) or not endpoint.startswith(ENDPOINT_SCHEMES):
        raise SocketSecurityError(f"{name} must be a str starting with one of {ENDPOINT_SCHEMES}, got {endpoint!r}")
    return endpoint


def is_loopback(endpoint: str) -> bool:
    """Whether a ``tcp://host:port`` endpoint names a loopback host (other schemes: True)."""
    if not endpoint.startswith("tcp://"):
        return True
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """A deployment's CURVE key pairs (Z85 text, as ``zmq.curve_keypair`` gives them)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __post_init__(self) -> None:
        for name in ("server_public", "server_secret", "client_public", "client_secret"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 40:
                raise SocketSecurityError(f"{name} must be a 40-byte Z85 CURVE key, got {len(value)!r:.20} bytes")

    def __repr__(self) -> str:
        return f"CurveKeys(server_public={self.server_public!r}, client_public={self.client_public!r})"

    @classmethod
    def generate(cls) -> CurveKeys:
        """Fresh server and client key pairs."""
        return cls(*zmq.curve_keypair(), *zmq.curve_keypair())

    def write(self, directory: str | os.PathLike) -> Path:
        """Write both pairs as ``zmq.auth`` certificate files into ``directory`` (the
        secret files readable by their owner only); the directory."""
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        for name, public, secret in (
            (SERVER_CERT, self.server_public, self.server_secret),
            (CLIENT_CERT, self.client_public, self.client_secret),
        ):
            target = path / f"{name}.key_secret"
            target.write_text(
                f'metadata\ncurve\n    public-key = "{public.decode()}"\n    secret-key = "{secret.decode()}"\n'
            )
            target.chmod(0o600)
            (path / f"{name}.key").write_text(f'metadata\ncurve\n    public-key = "{public.decode()}"\n')
        return path

    @classmethod
    def load(cls, directory: str | os.PathLike) -> CurveKeys:
        """The pairs of a certificate directory (``server.key_secret``, ``client.key_secret``)."""
        pairs = []
        for name in (SERVER_CERT, CLIENT_CERT):
            path = Path(directory) / f"{name}.key_secret"
            try:
                public, secret = zmq.auth.load_certificate(path)
            except (OSError, ValueError) as err:
                raise SocketSecurityError(f"cannot load CURVE keys from {str(path)!r}: {err}") from None
            if secret is None:
                raise SocketSecurityError(f"{str(path)!r} holds no secret key")
            pairs += [public, secret]
        return cls(*pairs)

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> CurveKeys | None:
        """The keys of the directory ``JAXKV_CURVE_DIR`` names, None when it is unset."""
        directory = env.get(ENV_CURVE_DIR)
        return None if not directory else cls.load(directory)


class _ClientKeyCheck:
    """The ZAP callback: admits the deployment's client key only."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.client_public


def _ipc_path_is_live(path: str) -> bool:
    """Whether a Unix socket at ``path`` accepts connections (a live socket holds it)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(0.5)
    try:
        probe.connect(path)
    except OSError:
        return False
    finally:
        probe.close()
    return True


class SecureContext:
    """A ZeroMQ context whose sockets follow the module's rules.

    ``curve``: the deployment's keys; None reads ``JAXKV_CURVE_DIR`` (still None when
    unset: no authentication, so no tcp unless ``plaintext_tcp``). Close it with
    :meth:`term` after closing its sockets.
    """

    def __init__(self, curve: CurveKeys | None = None, *, plaintext_tcp: bool = False) -> None:
        if curve is not None and not isinstance(curve, CurveKeys):
            raise SocketSecurityError(f"curve must be CurveKeys or None, got {type(curve).__name__}")
        self.keys = curve if curve is not None else CurveKeys.from_env()
        self.plaintext_tcp = bool(plaintext_tcp)
        self.context = zmq.Context()
        self._auth: ThreadAuthenticator | None = None

    @property
    def authenticated(self) -> bool:
        return self.keys is not None

    def check(self, name: str, endpoint: object, *, bind: bool) -> str:
        """``endpoint`` if a socket of this context may use it (see the module docstring)."""
        endpoint = check_endpoint(name, endpoint)
        if self.keys is None and endpoint.startswith(ABSTRACT_IPC):
            raise SocketSecurityError(
                f"{name} {endpoint!r}: abstract-namespace ipc has no file permissions (any local user may "
                f"connect); it needs CURVE keys (curve=, or {ENV_CURVE_DIR}), or use an ipc:// path"
            )
        if self.keys is None and endpoint.startswith("tcp://"):
            if not self.plaintext_tcp:
                raise SocketSecurityError(
                    f"{name} {endpoint!r}: tcp needs CURVE keys (curve=, or {ENV_CURVE_DIR}); "
                    "plaintext_tcp=True allows loopback without them"
                )
            if not is_loopback(endpoint):
                raise SocketSecurityError(f"{name} {endpoint!r}: plaintext tcp may bind or connect loopback only")
        if bind and endpoint.startswith("ipc://") and not endpoint.startswith(ABSTRACT_IPC):
            path = endpoint[len("ipc://") :]
            if os.path.exists(path) and _ipc_path_is_live(path):
                raise SocketSecurityError(f"{name} {endpoint!r}: a live socket already holds this path")
        return endpoint

    def bind(self, socket_type: int, name: str, endpoint: str, **options: int | bytes) -> zmq.Socket:
        """A socket of ``socket_type`` bound to ``endpoint`` (the CURVE server side),
        ``options`` set (``zmq`` option name -> value) before binding."""
        self.check(name, endpoint, bind=True)
        sock = self.context.socket(socket_type)
        try:
            for option, value in options.items():
                sock.setsockopt(getattr(zmq, option), value)
            if self.keys is not None:
                self._start_auth(self.keys)
                sock.curve_secretkey = self.keys.server_secret
                sock.curve_publickey = self.keys.server_public
                sock.curve_server = True
            sock.bind(endpoint)
        except zmq.ZMQError as err:
            sock.close(linger=0)
            raise SocketSecurityError(f"cannot bind {name} {endpoint!r}: {err}") from None
        return sock

    def connect(self, socket_type: int, name: str, endpoint: str, **options: int | bytes) -> zmq.Socket:
        """A socket of ``socket_type`` connected to ``endpoint`` (the CURVE client side),
        ``options`` set (``zmq`` option name -> value) before connecting."""
        self.check(name, endpoint, bind=False)
        sock = self.context.socket(socket_type)
        for option, value in options.items():
            sock.setsockopt(getattr(zmq, option), value)
        if self.keys is not None:
            sock.curve_secretkey = self.keys.client_secret
            sock.curve_publickey = self.keys.client_public
            sock.curve_serverkey = self.keys.server_public
        sock.connect(endpoint)
        return sock

    def term(self) -> None:
        """Stop the authenticator and end the context (its sockets must be closed)."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.context.term()

    def _start_auth(self, keys: CurveKeys) -> None:
        if self._auth is None:
            self._auth = ThreadAuthenticator(self.context)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=_ClientKeyCheck(keys.client_public))


@contextlib.contextmanager
def private_ipc_dir(prefix: str = "jaxkv-") -> Iterator[str]:
    """A fresh directory for ``ipc://`` endpoints, readable by this user only, removed after."""
    with tempfile.TemporaryDirectory(prefix=prefix) as directory:
        os.chmod(directory, 0o700)
        yield directory
