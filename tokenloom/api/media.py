"""The images of a request, fetched and decoded: ``data:`` URLs always, ``file://`` URLs only
under ``--allowed-local-media-path``, ``http(s)://`` URLs only from a host of
``--allowed-media-domains`` (fetched with a size and a time limit). Each failure is an
InvalidRequestError naming the content part. Blocking: the caller runs it off the event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import urllib.parse
from dataclasses import dataclass
from typing import Any

from tokenloom.errors import InvalidRequestError

# an image may hold at most this many pixels (decoded): larger ones are refused before decoding
MAX_IMAGE_PIXELS = 4096 * 4096
# an image fetched over http(s) may be at most this many bytes, and take at most this long
MAX_FETCHED_BYTES = 20 * 1024 * 1024
FETCH_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True)
class MediaPolicy:
    """Where a request's media may come from (the server's flags)."""

    # file:// URLs are read only under this directory ("": never)
    allowed_local_media_path: str = ""
    # http(s) URLs are fetched only from these host names (empty: never)
    allowed_media_domains: tuple[str, ...] = ()


def load_image(url: str, where: str, policy: MediaPolicy) -> Any:
    """The image at ``url`` as an RGB ``PIL.Image``; ``where`` names the content part in errors."""
    if not isinstance(url, str) or not url:
        raise InvalidRequestError(f"{where}: the image URL must be a non-empty string", param=where)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        data = _data_url_bytes(url, where)
    elif scheme == "file":
        data = _local_file_bytes(url, where, policy)
    elif scheme in ("http", "https"):
        data = _fetched_bytes(url, where, policy)
    else:
        raise InvalidRequestError(
            f"{where}: an image URL must be a data: URL (data:image/png;base64,...), an http(s) URL or a file:// URL",
            param=where,
        )
    return decode_image(data, where)


def decode_image(data: bytes, where: str) -> Any:
    """``data`` decoded by PIL, fully (a truncated file fails here), as RGB."""
    from PIL import Image

    try:
        image = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError:
        raise InvalidRequestError(f"{where}: the image has too many pixels; send a smaller one", param=where) from None
    except (OSError, ValueError):
        raise InvalidRequestError(
            f"{where}: not an image (PIL reads PNG, JPEG, GIF, WebP, BMP, ...)", param=where
        ) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise InvalidRequestError(
            f"{where}: the image is {width}x{height}, more than the {MAX_IMAGE_PIXELS} pixels an image may have; "
            "send a smaller one",
            param=where,
        )
    try:
        image.load()
    except (OSError, ValueError, SyntaxError) as exc:
        raise InvalidRequestError(f"{where}: the image is truncated or corrupt ({exc})", param=where) from None
    return image.convert("RGB")


def _data_url_bytes(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.endswith(";base64"):
        raise InvalidRequestError(f"{where}: a data: URL must be base64, as data:image/png;base64,<data>", param=where)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequestError(f"{where}: the data: URL's payload is not valid base64", param=where) from None


def _local_file_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    if not policy.allowed_local_media_path:
        raise InvalidRequestError(
            f"{where}: this server reads no local files; start it with --allowed-local-media-path DIR to allow "
            "file:// URLs under DIR",
            param=where,
        )
    path = os.path.realpath(urllib.parse.unquote(urllib.parse.urlparse(url).path))
    root = os.path.realpath(policy.allowed_local_media_path)
    if os.path.commonpath([path, root]) != root:
        raise InvalidRequestError(f"{where}: {path} is not under --allowed-local-media-path {root}", param=where)
    try:
        with open(path, "rb") as file:
            data = file.read(MAX_FETCHED_BYTES + 1)
    except OSError as exc:
        raise InvalidRequestError(f"{where}: cannot read {path}: {exc.strerror}", param=where) from None
    if len(data) > MAX_FETCHED_BYTES:
        raise InvalidRequestError(f"{where}: {path} is larger than {MAX_FETCHED_BYTES} bytes", param=where)
    return data


def _fetched_bytes(url: str, where: str, policy: MediaPolicy) -> bytes:
    host = (urllib.parse.urlparse(url).hostname or "").lower()
    if host not in policy.allowed_media_domains:
        allowed = ", ".join(policy.allowed_media_domains) or "none"
        raise InvalidRequestError(
            f"{where}: images are fetched only from --allowed-media-domains (now: {allowed}), not {host or url!r}; "
            "send the image as a data: URL instead",
            param=where,
        )
    import httpx

    try:
        with httpx.stream("GET", url, timeout=FETCH_TIMEOUT_SECONDS, follow_redirects=False) as response:
            if response.status_code != 200:
                raise InvalidRequestError(f"{where}: fetching {url} answered {response.status_code}", param=where)
            data = bytearray()
            for chunk in response.iter_bytes():
                data += chunk
                if len(data) > MAX_FETCHED_BYTES:
                    raise InvalidRequestError(f"{where}: {url} is larger than {MAX_FETCHED_BYTES} bytes", param=where)
            return bytes(data)
    except httpx.HTTPError as exc:
        raise InvalidRequestError(f"{where}: fetching {url} failed: {exc}", param=where) from None
