"""Calibrators: how activation and weight ranges are found (see :class:`jqt.Rule`).

Activations: :class:`MinMax` (default), :class:`MovingAverage`,
:class:`Percentile`, :class:`MSE`, :class:`Entropy` (KL); subclass
:class:`Calibrator` for your own. Weights: :class:`WeightMinMax` (default),
:class:`WeightMSE`.
"""
from jqt._src.calibrators import MSE as MSE
from jqt._src.calibrators import Calibrator as Calibrator
from jqt._src.calibrators import Entropy as Entropy
from jqt._src.calibrators import MinMax as MinMax
from jqt._src.calibrators import MovingAverage as MovingAverage
from jqt._src.calibrators import Percentile as Percentile
from jqt._src.calibrators import WeightCalibrator as WeightCalibrator
from jqt._src.calibrators import WeightMinMax as WeightMinMax
from jqt._src.calibrators import WeightMSE as WeightMSE
