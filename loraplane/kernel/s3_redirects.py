"""S3 clients that ask one endpoint and never chase a redirect.

botocore answers an S3 redirect (301, 302, 307, or a region error) by asking the store for
the bucket's region with ``HeadBucket`` and retrying elsewhere; a store that redirects that
request too makes it recurse until RecursionError, which no caller expects. loraplane's
clients (the worker's artifact fetch, publish, the local stack) never ask ``HeadBucket``
themselves, so one is that probe: it is refused before it is sent, as a botocore error that
every caller already handles."""

from __future__ import annotations

from typing import Any

from botocore.exceptions import BotoCoreError

__all__ = ["RedirectRefused", "refusing_redirects"]


class RedirectRefused(BotoCoreError):
    """The store answered with a redirect; loraplane asks the endpoint it was given only."""

    fmt = "the store answered a redirect"


def _refuse_region_probe(**_: Any) -> None:
    raise RedirectRefused()


def refusing_redirects(client: Any) -> Any:
    """``client`` (a boto3 S3 client), refusing botocore's region probe; returned."""
    client.meta.events.register("before-call.s3.HeadBucket", _refuse_region_probe)
    return client
