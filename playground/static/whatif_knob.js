async (key, note, explain, step, model, quantization, width, ...values) => {
  if (!key) return [note, explain];
  const seq = window.dp.whatIfSeq = (window.dp.whatIfSeq || 0) + 1;
  let reply;
  try {
    const res = await (__POST__)({key, step, model, quantization, width, values});
    reply = await res.json();
  } catch (err) {
    reply = {fallback: true};
  }
  if (seq !== window.dp.whatIfSeq) return [note, explain];
  if (reply.fallback) {
    const button = document.getElementById(__ID_STEP_WHATIF_FALLBACK__);
    if (button) button.click();
    return [note, explain];
  }
  if (reply.figure) (__DRAW_STEP__)(reply.figure);
  return [reply.note || note, reply.figure && reply.explain ? reply.explain : explain];
}
