"""megascale-data imports on its own, with its version, and without pulling in packages it must not need."""

import subprocess
import sys


def test_imports_alone_with_a_version():
    code = "import megascale.data as m; print(m.__version__)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() and out.strip() != "0.0.0+unknown"
