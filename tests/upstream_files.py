"""TFDS's own Fashion-MNIST download served offline: Debian's files with upstream's gzip headers.

Debian's dataset-fashion-mnist ships upstream's gzip files with the header normalised
(strip-nondeterminism drops the file name and sets the time); the compressed data are upstream's
byte for byte. Putting the name and upstream's time back gives exactly the files TFDS downloads,
which its registered SHA-256 checksums then accept. A local HTTP proxy serves them at the URLs
TFDS asks for, so the real download, checksum, extraction and preparation path runs without
internet.
"""

import http.server
import os
import struct
import threading

from conftest import FASHION_MNIST

URL = "http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/"
# Each file's modification time in upstream's gzip header (found by matching TFDS's checksums).
UPSTREAM_MTIME = {
    "train-images-idx3-ubyte": 1504176606,
    "train-labels-idx1-ubyte": 1504176606,
    "t10k-images-idx3-ubyte": 1504176627,
    "t10k-labels-idx1-ubyte": 1504176627,
}


def upstream_gzip(name: str) -> bytes:
    """Upstream's .gz file `name` rebuilt from Debian's copy."""
    with open(os.path.join(FASHION_MNIST, name + ".gz"), "rb") as f:
        data = f.read()
    assert data[:4] == b"\x1f\x8b\x08\x00", f"{name}.gz: not a plain gzip header"
    flags_name = b"\x1f\x8b\x08\x08"  # FNAME set: the original file name follows the header
    return flags_name + struct.pack("<I", UPSTREAM_MTIME[name]) + data[8:10] + name.encode() + b"\0" + data[10:]


class UpstreamProxy:
    """An HTTP proxy on 127.0.0.1 that answers Fashion-MNIST's URLs from upstream_gzip; `served` lists them."""

    def __init__(self):
        self.served = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                name = self.path.rsplit("/", 1)[-1]
                if not self.path.startswith(URL) or name[:-3] not in UPSTREAM_MTIME:
                    self.send_error(404)
                    return
                body = upstream_gzip(name[:-3])
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                owner.served.append(name)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        return False
