async (key, note, explain, step, model, quantization, width, ...values) => {
  if (!key) return;  // no run yet: nothing to draw, every output stays as it is
  const seq = window.dp.whatIfSeq = (window.dp.whatIfSeq || 0) + 1;
  const chart = window.dp.stepChartSeq;  // the step chart this what-if is asked for (whatif_prepare.js counts)
  let reply;
  try {
    const res = await (__POST__)({key, step, model, quantization, width, values});
    reply = await res.json();
  } catch (err) {
    reply = {fallback: true};
  }
  // A later change is on its way, or the chart was replaced meanwhile (a new run, another step, a
  // new width): this answer is about a chart no longer shown, so nothing of it is drawn or said.
  if (seq !== window.dp.whatIfSeq || chart !== window.dp.stepChartSeq) return;
  if (reply.fallback) {
    const button = document.getElementById(__ID_STEP_WHATIF_FALLBACK__);
    if (button) button.click();
    return;
  }
  if (reply.figure) (__DRAW_STEP__)(reply.figure);
  // An output left undefined keeps what it shows.
  return [reply.note || undefined, reply.figure && reply.explain ? reply.explain : undefined];
}
