(id) => {
  if (!id) return;
  // The part of the view where this run's result appears, when that is not the top of the tab (the
  // KV cache section, below the drift table): shown once the run is pressed.
  const LANDINGS = __LANDINGS__;
  let tries = 0;
  const press = () => {
    const button = document.getElementById(id);
    if (button && button.offsetParent !== null) {
      button.click();
      const land = LANDINGS[id] && document.getElementById(LANDINGS[id]);
      if (land) land.scrollIntoView({block: 'start'});
    } else if (++tries < 50) setTimeout(press, 100);
  };
  press();
}
