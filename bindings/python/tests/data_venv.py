"""The PyPI packages of the tests that tokenize (data_test, fit_data_test): a venv with them, made once by
tests/e2e/pip_venv.sh (kept in ~/.cache/seqgrad-pip), runs a test whose Python lacks them."""
import os
import subprocess
import sys

REQUIREMENTS = ["transformers==5.23.0", "tokenizers==0.23.3", "jinja2==3.1.6", "datasets==5.2.0",
                "hypothesis==6.170.15"]


def _have_requirements():
    try:
        import datasets, hypothesis, jinja2, tokenizers, transformers  # noqa: F401
        return True
    except ImportError:
        return False


def _venv_python():
    script = os.path.join(os.environ["TEST_SRCDIR"], "seqgrad", "tests", "e2e", "pip_venv.sh")
    venv = subprocess.run([script] + REQUIREMENTS, check=True, stdout=subprocess.PIPE, text=True).stdout.strip()
    return os.path.join(venv, "bin", "python")


def run_in_venv(script):
    """Replaces this process with `script` under the venv's Python unless this one has the packages."""
    if not _have_requirements():
        python = _venv_python()
        os.execv(python, [python, os.path.abspath(script)] + sys.argv[1:])  # PYTHONPATH (seqgrad) carries over
