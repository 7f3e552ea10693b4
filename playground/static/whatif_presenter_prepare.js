(key, model, quantization) => {
  // The presenter's chart got a new figure (a run, another step): slider answers asked for the one
  // before are stale (whatif_presenter.js compares this count).
  window.dp.presentChartSeq = (window.dp.presentChartSeq || 0) + 1;
  const label = document.querySelector('#' + __ID_PRESENT_TEXT__ + ' .dp-present-label');
  if (!key || !label) return;
  (__POST__)({prepare: true, key, step: Number(label.dataset.step), model, quantization}).catch(() => {});
}
