"""Images fetched and decoded for a chat request (api/media.py): each source only where the
server allows it, each failure an InvalidRequestError naming the part."""

from __future__ import annotations

import base64
import http.server
import threading

import pytest
from helpers.llava_checkpoint import drawn_image, png_bytes

from tokenloom.api.media import MAX_IMAGE_PIXELS, MediaPolicy, decode_image, load_image
from tokenloom.errors import InvalidRequestError

WHERE = "messages[0].content[1]"


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


NOTHING_ALLOWED = MediaPolicy()


def refusal(url: str, policy: MediaPolicy = NOTHING_ALLOWED) -> str:
    with pytest.raises(InvalidRequestError) as raised:
        load_image(url, WHERE, policy)
    assert raised.value.param == WHERE
    return raised.value.message


def test_a_data_url_decodes_to_the_rgb_image():
    image = load_image(data_url(png_bytes(drawn_image("red"))), WHERE, MediaPolicy())
    assert (image.mode, image.size, image.getpixel((10, 10))) == ("RGB", (40, 30), (255, 0, 0))


def test_bad_data_urls_name_the_part():
    assert "not an image" in refusal(data_url(b"hello"))
    assert "truncated" in refusal(data_url(png_bytes(drawn_image("red"))[:80]))
    assert "not valid base64" in refusal("data:image/png;base64,@@@")
    assert "must be base64" in refusal("data:image/png,rawbytes")
    assert "must be a data: URL" in refusal("ftp://example.org/a.png")


def test_an_image_of_too_many_pixels_is_refused_before_it_is_decoded():
    from PIL import Image

    side = int(MAX_IMAGE_PIXELS**0.5) + 1
    with pytest.raises(InvalidRequestError, match=f"{side}x{side}"):
        decode_image(png_bytes(Image.new("L", (side, side))), WHERE)


def test_file_urls_only_under_the_allowed_path(tmp_path):
    (tmp_path / "a.png").write_bytes(png_bytes(drawn_image("blue")))
    assert "--allowed-local-media-path" in refusal(f"file://{tmp_path}/a.png")
    policy = MediaPolicy(allowed_local_media_path=str(tmp_path / "sub"))
    (tmp_path / "sub").mkdir()
    assert "not under" in refusal(f"file://{tmp_path}/sub/../a.png", policy)
    image = load_image(f"file://{tmp_path}/a.png", WHERE, MediaPolicy(allowed_local_media_path=str(tmp_path)))
    assert image.getpixel((10, 10)) == (0, 0, 255)


@pytest.fixture
def image_host():
    body = png_bytes(drawn_image("green"))

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            found = self.path == "/green.png"
            self.send_response(200 if found else 404)
            self.end_headers()
            if found:
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_http_urls_only_from_the_allowed_domains(image_host):
    assert "--allowed-media-domains (now: none)" in refusal(f"{image_host}/green.png")
    allowed = MediaPolicy(allowed_media_domains=("127.0.0.1",))
    assert load_image(f"{image_host}/green.png", WHERE, allowed).getpixel((10, 10)) == (0, 128, 0)
    assert "answered 404" in refusal(f"{image_host}/missing.png", allowed)
    assert "not 'localhost'" in refusal(image_host.replace("127.0.0.1", "localhost") + "/green.png", allowed)
