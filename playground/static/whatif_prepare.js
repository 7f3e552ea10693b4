(key, step, model, quantization) => {
  // The step chart got a new figure from the server (a run, a step, a width): what-ifs asked for the
  // one before are stale (whatif_knob.js compares this count).
  window.dp.stepChartSeq = (window.dp.stepChartSeq || 0) + 1;
  if (!key) return;
  (__POST__)({prepare: true, key, step, model, quantization}).catch(() => {});
}
