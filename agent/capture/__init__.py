"""Capture: the mechanics the collectors use to read torch objects without a host sync.

``agent/collectors/`` says *what* is measured and *when* (one class per signal family, its
``emits``, its cadence); this package holds *how*, shared by several collectors or by the step
path: the ``clip_grad_norm_`` patch (``clip``), fused norms (``norms``), activation statistics
(``activation_stats``), EMA tensor pairing and divergence (``ema_pairs``, ``ema_worker``), the
attention-logit torch function mode (``attention``), the NaN-origin replay (``replay``) and DTensor
shards (``shards``). Nothing here registers a collector or names a wire field.
"""
