"""The guard's defaults and the defense names, each with the measurement that chose it (docs/results.md).

``flguard.guard.config`` builds ``GuardConfig``'s fields from these; the engine and the Flower mod read the
defense groups. Kept apart so that a default's reason sits beside its value without crowding the models.
"""

from __future__ import annotations

DEFENSES = ("none", "auto", "gaussian", "rowspace", "resolvent", "eigen", "fixed-gaussian", "pruning", "localdp")
#: The defense of ``GuardConfig()``: see AutoGuardConfig.
DEFAULT_DEFENSE = "auto"
#: Defenses that promise a per-sample floor (the others are baselines reported honestly).
THRESHOLD_DEFENSES = ("auto", "gaussian", "rowspace", "resolvent", "eigen")
#: The default floor, in pixel PSNR (dB): chosen from ``benchmarks/study_floor.py`` (docs/results.md,
#: "The default floor"): on MNIST digits a reconstruction 15 dB from the truth is at the edge of
#: recognisable for smooth or faded errors (the trained CNN reads 63–81% of them, SSIM ≤ 0.57) and
#: still readable for pixel noise (88%); the guard's floor is a first-order worst case, and the
#: demo's strongest attacks then land at ≈ 9–10 dB, where they recognise 0–1 of 3 probes.
DEFAULT_MAX_PSNR = 15.0
#: τ in model-input units when neither a floor nor the normalisation is given: the default PSNR for
#: inputs that are raw [0, 1] pixels (≈ 0.178; it was 0.05 ≈ 26 dB there, 36 dB on normalised MNIST).
DEFAULT_MIN_RMSE = 10 ** (-DEFAULT_MAX_PSNR / 20)

#: The per-step cap on Jacobian products per sample (``max_products``): the guard's solves take 20–40
#: on the demo's CNN and ResNets (docs/results.md), so this only stops a runaway solve — one that
#: would otherwise run to the input size (3,072 products on 32×32 colour images, minutes per step).
DEFAULT_MAX_PRODUCTS = 400.0

#: The threshold defenses' defaults that send on trained models (docs/results.md, "Defaults that
#: send"): per-sample clipping at the batch's median per-sample gradient norm (a clip level that needs
#: no tuning, and a budget unit C that scales with the model), a budget of 40 C, up to a quarter of
#: a batch left out of a step (samples whose gradient is < 1% of C do not count), and solves to
#: rtol 3e-2 (at 1e-3 float32 products on trained models keep some samples from certifying; each
#: sample's certified bound takes its own verified solver error off — with the box, by the
#: saturation-aware bound of ``flguard.guard.box_bound`` — and is fitted to τ(1 + rtol): on the trained
#: CNN 3e-2 takes 13% fewer products than 1e-2 for the same accuracy). On the trained quickstart CNN (B = 32)
#: they sent 20 of 20 steps; without them 0 of 20. The clip level: ``"auto"`` (``flguard.guard.clipping.AdaptiveClip``)
#: — ``"retention"`` (the smallest per-sample norm from the median up whose clipped sum keeps ``clip_retention`` of the
#: batch gradient's length along it) while the noise sent keeps the weights' moves within 5% in root mean square
#: (``CLIP_MAX_MOVE``), else the median. The median alone keeps 0.5–1.6% of the trained CNN's step along the gradient,
#: and its rounds ended 2.4–7.1 points below unguarded training (three seeds of five within 5 points); ``"auto"``
#: ended 0.7–3.5 points below on five of five; "retention" alone did as well there but collapsed one of six
#: from-scratch federated runs, its noise moving the weights by 7.5–24% a step in root mean square; ``"auto"`` kept
#: those moves under 5% and nine such runs did not collapse (60.1% on average, the median's six 63.8%; docs/results.md,
#: "A clip level for both regimes").
#: Without a step size it is the median: for Adam and the other optimizers ``make_guarded`` measures their own step
#: (``flguard.guard.trial_step``) and the median, and fractions of it, are judged by the noise's damage to it.
DEFAULT_CLIP = "auto"
DEFAULT_CLIP_RETENTION = 0.25
#: ``auto``'s aimed noise where the Gaussian is not sent (``flguard.guard.perturb.auto_order``): resolvent noise,
#: whose direction comes from the λmax Lanczos run the guard runs anyway (9 steps instead of 5–7). Measured
#: (docs/results.md, "Resolvent noise from the λmax run, and auto's fallback"): ResNet-18-GN at B = 8 on a CPU 30
#: products per sample and 256–296× a training step against eigen's 135 and 1,297×; the CNN trained from scratch by
#: federated rounds (three seeds, two runs each) 63.8% on average against eigen's 63.1%, at half its time. "eigen"
#: (64 Lanczos steps, 32 directions per sample) stays available.
DEFAULT_FALLBACK = "resolvent"
DEFAULT_MAX_REL_NOISE = 40.0
DEFAULT_MAX_EXCLUDED = 0.25
DEFAULT_RTOL = 3e-2
#: Fields with a non-None default that None switches off: the string "none" means None too (a run
#: config cannot carry None; ``flguard.flower.guard_mod`` writes "none").
NONE_STRINGS = ("clip_per_sample", "max_products")
