"""The QR code decodes back to the share link (OpenCV's detector is the oracle)."""

import base64

import cv2
import numpy as np
import pytest

from playground.qr import qr_html, qr_png_data_url


def decode(data_url: str) -> str:
    png = base64.b64decode(data_url.split(",", 1)[1])
    image = cv2.imdecode(np.frombuffer(png, dtype=np.uint8), cv2.IMREAD_GRAYSCALE)
    text, _points, _ = cv2.QRCodeDetector().detectAndDecode(image)
    return text


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:7860/?view=step&s=eJxLy0ksyS9KTVEoSc0tUEjOzy0oSi0uBgBijAhq.c0ffee",
    "https://huggingface.co/spaces/me/decoding-playground?view=compare&s=" + "A" * 600,
])
def test_qr_decodes_to_the_link(url):
    assert decode(qr_png_data_url(url)) == url


def test_html_escapes_the_caption():
    html = qr_html("http://x/?a=<b>")
    assert "<b>" not in html.split("figcaption")[1] and "&lt;b&gt;" in html


@pytest.mark.parametrize("bad", ["", "   ", None, 5, "x" * 5000])
def test_bad_links_are_refused_with_the_argument_named(bad):
    with pytest.raises(ValueError, match="^url:"):
        qr_png_data_url(bad)


def test_a_long_links_caption_is_shortened_but_its_code_holds_it_whole():
    url = "http://room.example/?lesson=l1." + "A" * 400
    html = qr_html(url)
    caption = html.split("<figcaption>")[1].split("</figcaption>")[0]
    assert len(caption) < 120 and caption.endswith("…")
    assert qr_png_data_url(url) in html  # the code is the whole link
