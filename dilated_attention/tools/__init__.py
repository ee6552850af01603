"""Command-line tools installed with the package (``python -m dilated_attention.tools.<name>`` or the console
script in brackets); each answers ``--help`` and exits non-zero with a plain-language finding.

* ``diagnose`` (``dilated-attention-diagnose``): versions, devices, strided views, each kernel against the oracle,
  ring and link health (``torchrun ... -m dilated_attention.tools.diagnose ring --distributed``)
* ``repro`` (``dilated-attention-repro``): show a captured call, or replay it against the float64 oracle
* ``fuzz`` (``dilated-attention-fuzz``): random valid and invalid calls against the oracle
* ``contiguity_audit`` (``dilated-attention-audit``): strided views that reach code assuming contiguous memory

The checks themselves live in ``dilated_attention.diagnostics``; these modules only parse arguments and print.
"""
