"""kdn.kernels: tensor work (quantize/pack, lossy codecs).

Importing this package registers the lossy codecs with ``kdn.format.codecs``
(``int8-*``, ``int8z-*``, ``int4-g*-*``, ``cachegen-*``, ``ans*-*``, ``kvtc``); it imports torch,
so ``import kdn`` itself never imports it.
"""

from kdn.kernels import cachegen, codecs, transform  # noqa: F401  (registers the codecs)
from kdn.kernels.encodings import encode_as as encode_as, encoding_plan as encoding_plan  # (re-exported)
