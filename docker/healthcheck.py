"""Container HEALTHCHECK: exit 0 once `layerstream serve` answers /health with 200 (model loaded),
1 while it loads (503), failed, or is not listening yet. Standard library only, so it works in any
base image without curl."""

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    host = os.environ.get("LAYERSTREAM_HOST", "0.0.0.0")
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # a wildcard bind answers on loopback
    url = f"http://{host}:{os.environ.get('LAYERSTREAM_PORT', '8000')}/health"
    try:
        with urllib.request.urlopen(url, timeout=float(os.environ.get("HEALTHCHECK_TIMEOUT", "4"))) as r:
            print(f"{url}: {r.status} {r.read(200).decode(errors='replace')}")
            return 0
    except urllib.error.HTTPError as e:
        print(f"{url}: {e.code} {e.read(200).decode(errors='replace')}")
    except OSError as e:
        print(f"{url}: {e}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
