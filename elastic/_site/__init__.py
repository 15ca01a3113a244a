"""The exec path's ``sitecustomize`` folder (see :mod:`elastic.autoprogress`); a package only so that it is
shipped with the library. It is put first on a worker's ``PYTHONPATH``, never imported by name."""
