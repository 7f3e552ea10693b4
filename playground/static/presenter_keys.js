() => {
  if (window.dp.presenterKeys) return;
  window.dp.presenterKeys = true;
  document.addEventListener("keydown", (e) => {
    const view = document.getElementById(__ID_PRESENTER__);
    if (!view || !view.getClientRects().length) return;  // offsetParent is null for a fixed overlay
    const tag = (document.activeElement && document.activeElement.tagName) || "";
    if (["INPUT", "TEXTAREA", "SELECT"].includes(tag)) return;
    const code = document.querySelector("#" + __ID_PRESENT_QR__ + ".dp-qr-big");
    if (e.key === "Escape" && code) { e.preventDefault(); code.classList.remove("dp-qr-big"); return; }
    const keys = {ArrowRight: __ID_PRESENT_NEXT__, ArrowLeft: __ID_PRESENT_PREV__, Escape: __ID_PRESENT_EXIT__};
    const id = keys[e.key];
    if (id) { e.preventDefault(); document.getElementById(id)?.click(); }
  });
}
