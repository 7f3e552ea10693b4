() => {
  if (window.dpPresenterKeys) return;
  window.dpPresenterKeys = true;
  document.addEventListener("keydown", (e) => {
    const view = document.querySelector("#presenter");
    if (!view || !view.getClientRects().length) return;  // offsetParent is null for a fixed overlay
    const tag = (document.activeElement && document.activeElement.tagName) || "";
    if (["INPUT", "TEXTAREA", "SELECT"].includes(tag)) return;
    const code = document.querySelector("#present-qr.dp-qr-big");
    if (e.key === "Escape" && code) { e.preventDefault(); code.classList.remove("dp-qr-big"); return; }
    const keys = {ArrowRight: "#present-next", ArrowLeft: "#present-prev", Escape: "#present-exit"};
    const id = keys[e.key];
    if (id) { e.preventDefault(); document.querySelector(id)?.click(); }
  });
}
