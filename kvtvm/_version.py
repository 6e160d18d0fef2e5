"""The version of kvtvm, in one place: ``kvtvm.__version__``, setup.py and the manifests
written beside built kernels all read it from here."""

__version__ = "0.1.0"
