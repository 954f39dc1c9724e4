"""Quantization-aware fine-tuning: which leaves of ``(params, qparams)`` train
(:func:`jqt.qat.labels`, :func:`jqt.qat.split`), and :func:`jqt.qat.project` after each
update. See the guide, docs/fine-tuning.md."""
from jqt._src.qat import PARTS as PARTS
from jqt._src.qat import labels as labels
from jqt._src.qat import merge as merge
from jqt._src.qat import parts as parts
from jqt._src.qat import project as project
from jqt._src.qat import split as split
