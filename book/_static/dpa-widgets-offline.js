// Point require.js at the local copies under _static/dpa-assets/, so that the ipywidgets html-manager renders
// anywidgets from saved state without a CDN:
// * anywidget's AMD module (dpa-assets/anywidget.js);
// * the html-manager's own AMD modules. They are defined inside embed-amd.js, but each webpack bundle finds its
//   assets (the Font Awesome files of its CSS) next to the URL require.js gives its module name. Unmapped, that
//   is relative to the page (book/@jupyter-widgets/html-manager/dist/...), where no font files are: every page
//   with a widget would log "Failed to load resource". Mapped, it is dpa-assets/html-manager/, where
//   book/_ext/dpa_book_assets.py copies the fonts with the scripts.
(function () {
  var here = document.currentScript.src;
  var base = here.substring(0, here.lastIndexOf("/") + 1) + "dpa-assets/";
  window.requirejs.config({
    paths: {
      anywidget: base + "anywidget",
      "@jupyter-widgets/html-manager": base + "html-manager/html-manager",
      "@jupyter-widgets/html-manager/dist": base + "html-manager",
    },
  });
})();
