"""moto's S3 server with authentication on: the one key of the stack, everything else refused.

Plain ``python -m moto.server`` accepts any credentials and serves ``/moto-api/`` (reset
the state, switch authentication off, dump every key) to whoever reaches the port. This
entry point runs the same WSGI app with IAM authentication from the first request, one IAM
user whose access key is ``--access-key-id`` with the secret in ``--secret-file`` (mode
0600, made by ``stack up``), allowed ``s3:*`` and nothing else, and ``/moto-api/`` closed.
An unsigned request gets 403 AccessDenied; ``GET /_health`` (not a bucket name) answers
200 for readiness probes.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from loraplane.kernel.config import LOOPBACK
from loraplane.kernel.secrets import read_secret

USER = "loraplane"
HEALTH_PATH = "/_health"
_ANONYMOUS = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
              b"<Message>Anonymous access is not allowed</Message></Error>")
_S3_ONLY = {"Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


def add_key(access_key_id: str, secret: str) -> None:
    """The IAM user of the stack, with our access key instead of a random one."""
    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.iam.models import iam_backends

    iam = iam_backends[DEFAULT_ACCOUNT_ID]["global"]
    iam.create_user(region_name="us-east-1", user_name=USER)
    iam.put_user_policy(USER, "s3-only", json.dumps(_S3_ONLY))
    key = iam.create_access_key(USER)
    key.access_key_id, key.secret_access_key = access_key_id, secret


def guarded(app: Callable[..., Iterable[bytes]]) -> Callable[..., Iterable[bytes]]:
    """``/moto-api/`` refused (it could switch authentication off); ``/_health`` open."""
    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == HEALTH_PATH:
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok"]
        if path.startswith("/moto-api"):
            start_response("403 Forbidden", [("Content-Type", "text/plain")])
            return [b"the moto API is closed on this server"]
        query = environ.get("QUERY_STRING", "")
        if "HTTP_AUTHORIZATION" not in environ and "Signature=" not in query:
            start_response("403 Forbidden", [("Content-Type", "application/xml")])
            return [_ANONYMOUS]  # moto itself answers an unsigned request with a 500
        return app(environ, start_response)
    return wsgi


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="moto S3 with authentication (loopback)")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--access-key-id", required=True)
    parser.add_argument("--secret-file", type=Path, required=True)
    args = parser.parse_args(argv)
    from moto import settings as moto_settings
    from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import run_simple

    add_key(args.access_key_id, read_secret(args.secret_file))
    moto_settings.INITIAL_NO_AUTH_ACTION_COUNT = 0
    app = DomainDispatcherApplication(create_backend_app)
    run_simple(LOOPBACK, args.port, guarded(app), threaded=True,
               request_handler=MotoRequestHandler)


if __name__ == "__main__":
    main()
