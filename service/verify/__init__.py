"""Numerical parity of exports against their source; see :mod:`service.verify.parity`."""
